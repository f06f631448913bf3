"""Speculative decoding: a drafter guesses the next tokens, one step through the route checks them all.

Greedy verification: the step carries the last accepted token and k drafted ones at the session's position;
the head scores all k + 1 positions; we keep the drafts that equal the greedy pick after their prefix, plus
the pick after the last kept one, so the output is exactly that of plain greedy decoding. Rejected positions
need no extra message: `rewind` moves the session's position back, and the peers cut their caches back to
the position of the next step that reaches them (swarm.models.blocks.BlockRange.forward). The decode loop
with drafts is client.generation.speculative_ids.

Sampled verification (temperature > 0) is speculative sampling for drafts that are one guess each (the
drafter's distribution q is all on its token): `sampled_accept` keeps each token distributed exactly as plain
sampling would draw it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from client.config import SPECULATE_CHOICES


class Drafter(Protocol):
    """Proposes the tokens likely to follow ``history`` (prompt and answer so far): at most ``k``, maybe none."""

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...


@runtime_checkable
class StatefulDrafter(Protocol):
    """A drafter that keeps state per session (a model drafter's KV cache, client.draft_model)."""

    # catch up with ``history`` where more than its last token is new (after the prompt, or steps without
    # drafts), outside a timed step: a step's time is that of its own drafts
    def prepare(self, history: Sequence[int]) -> None: ...

    def close(self) -> None: ...  # free the state; a later proposal starts it again


@runtime_checkable
class Verifier(Protocol):
    """A session that can score every position of a step and forget its last tokens (InferenceSession)."""

    async def forward(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor: ...

    # -> logits[T, V], row i after new_ids[i]
    async def forward_all(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor: ...

    def rewind(self, length: int) -> None: ...  # forget the tokens at positions >= length


class ModelDrafters(Protocol):
    """Makes a drafter per session from weights they share (client.draft_model.DraftModel)."""

    def drafter(self) -> Drafter: ...


class Target(Protocol):
    """A sampler's distribution and its random draws (swarm.models.head.Sampler)."""

    def distribution(self, logits: torch.Tensor, previous_token_ids: Sequence[int]) -> torch.Tensor: ...

    def draw(self, probs: torch.Tensor) -> int: ...

    def uniform(self) -> float: ...


class PromptLookup:
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens (n from ``max_ngram``
    down to ``min_ngram``) and propose the tokens that followed it. No model; pays off where the answer
    repeats its input (edits, code, quotes)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        tokens = list(history)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first, never the tail itself
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []


def make_speculation(
    speculate: str, draft_tokens: int, model: ModelDrafters | None = None
) -> Speculation | None:
    """A session's speculation as ClientConfig.speculate and draft_tokens say (None for "off"); "model" and
    "self" draft with ``model`` (client.draft_model.load_draft_model)."""
    if speculate == "off":
        return None
    if speculate == "lookup":
        return Speculation(PromptLookup(), draft_tokens, DraftLength(draft_tokens))
    if speculate in ("model", "self"):
        if model is None:
            raise ValueError(f"speculate={speculate!r} needs a draft model, and the client has none loaded")
        return Speculation(model.drafter(), draft_tokens, DraftLength(draft_tokens))
    raise ValueError(f"speculate must be one of {', '.join(SPECULATE_CHOICES)}, got {speculate!r}")


def accept(drafts: Sequence[int], picks: Sequence[int]) -> list[int]:
    """The tokens a verified step yields: ``picks[i]`` is the target's pick after drafts[:i] (len(drafts) + 1
    of them); keep the drafts that equal the pick at their place, then the first pick that differs (or the
    pick after all drafts)."""
    kept: list[int] = []
    for draft, pick in zip(drafts, picks, strict=False):
        kept.append(pick)
        if draft != pick:
            return kept
    kept.append(picks[len(drafts)])
    return kept


def sampled_accept(
    drafts: Sequence[int], rows: torch.Tensor, history: Sequence[int], target: Target
) -> list[int]:
    """The tokens a verified step yields when sampling: row i of ``rows`` is the logits after
    history + drafts[:i]. Draft i is kept with probability p_i(draft); at the first one refused, a token is
    drawn from p_i without the draft (max(p - q, 0) renormalised, q being all on the draft), and that ends
    the step; if all are kept, one more is drawn from the last row. Each token is then distributed as plain
    sampling would draw it after the tokens before it."""
    kept: list[int] = []
    for i, draft in enumerate(drafts):
        probs = target.distribution(rows[i], [*history, *kept])
        if target.uniform() < float(probs[draft]):
            kept.append(draft)
            continue
        probs[draft] = 0.0
        kept.append(target.draw(probs))
        return kept
    kept.append(target.draw(target.distribution(rows[len(drafts)], [*history, *kept])))
    return kept


class DraftLength:
    """Each step's number of drafts, from the session's own measurements: the chance ``alpha`` that a draft
    is kept once those before it were, and the time of a step of n tokens, t(n) = a + b n (a: the route's
    round trip and per-step costs; b: each token's compute). A step with k drafts yields on average
    (1 - alpha^(k+1)) / (1 - alpha) tokens; the k with the most tokens per second wins, and k = 0 (no drafts)
    wins where drafts do not pay, e.g. on a fast link with a weak drafter. While off, a step with ``probe_k``
    drafts now and then (``probe_every``, doubling up to ``max_probe_every`` while they keep not paying)
    re-measures; the first step with drafts carries ``probe_k`` too."""

    def __init__(
        self,
        max_k: int,
        decay: float = 0.9,
        probe_every: int = 8,
        max_probe_every: int = 64,
        probe_k: int = 2,
    ) -> None:
        if max_k < 1 or not 0 < decay < 1 or not 1 <= probe_every <= max_probe_every or probe_k < 1:
            raise ValueError(f"bad draft length settings: {max_k}, {decay}, {probe_every}, {max_probe_every}")
        self.max_k = max_k
        self.decay = decay
        self.min_probe_every = self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_k = (
            probe_k  # drafts of a measuring step: few, so a step where drafts do not pay costs little
        )
        self.kept = (
            1.0  # decayed drafts kept, and drafts judged (kept or the one refused): alpha = kept / judged
        )
        self.judged = 2.0  # (a prior of 1 in 2, worth two drafts)
        self.times: dict[int, float] = {}  # tokens in a step -> its decayed mean time, seconds
        self.since_drafts = 0  # plain steps since the last one with drafts

    @property
    def alpha(self) -> float:
        return min(self.kept / self.judged, 0.99)

    def step_s(self, tokens: int) -> float | None:
        """t(tokens) from the means seen, on the line through the two nearest counts; None before two."""
        if tokens in self.times:
            return self.times[tokens]
        if len(self.times) < 2:
            return None
        (n1, t1), (n2, t2) = sorted(self.times.items(), key=lambda item: abs(item[0] - tokens))[:2]
        slope = max((t2 - t1) / (n2 - n1), 0.0)  # a token never makes a step faster
        return max(t1 + slope * (tokens - n1), 1e-9)

    def tokens_per_s(self, k: int) -> float | None:
        seconds = self.step_s(k + 1)
        if seconds is None:
            return None
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a) / seconds

    def choose(self, most: int) -> int:
        """How many drafts the next step carries, at most ``most``."""
        top = min(self.max_k, most)
        if top <= 0:
            return 0
        probe = min(self.probe_k, top)
        # First measure a step with drafts and a plain one (whichever the drafter's luck gives first).
        if not self.times:
            return probe
        if 1 not in self.times:
            return 0
        if len(self.times) == 1:
            return probe
        rates = {k: self.tokens_per_s(k) for k in range(top + 1)}
        best = max(rates, key=lambda k: rates[k] or 0.0)
        if best > 0:
            self.probe_every = self.min_probe_every
            return best
        if self.since_drafts + 1 >= self.probe_every:
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            return probe
        return 0

    def observe(self, tokens: int, seconds: float, drafted: int, kept: int) -> None:
        """A step of ``tokens`` tokens took ``seconds``; it carried ``drafted`` drafts, ``kept`` of them kept."""
        old = self.times.get(tokens)
        self.times[tokens] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        if drafted == 0:
            self.since_drafts += 1
            return
        self.since_drafts = 0
        judged = kept + (1 if kept < drafted else 0)
        self.kept = self.decay * self.kept + kept
        self.judged = self.decay * self.judged + judged


@dataclass
class Speculation:
    """How a session speculates, and its counters: steps that carried drafts, drafted and accepted tokens.
    With ``length``, each step's drafts are as many as it chooses (at most draft_tokens); without, always
    draft_tokens where the drafter has them."""

    drafter: Drafter
    draft_tokens: int  # most drafts per step
    length: DraftLength | None = None
    clock: Callable[[], float] = time.perf_counter
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def length_for(self, most: int) -> int:
        """How many drafts the next step carries: at most ``most`` (room left in the answer)."""
        k = min(self.draft_tokens, most)
        if self.length is not None and k > 0:
            k = self.length.choose(k)
        return max(k, 0)

    def drafts(self, history: Sequence[int], k: int) -> list[int]:
        """At most ``k`` drafts to follow ``history``."""
        return self.drafter.propose(history, k)[:k] if k > 0 else []

    def drafts_for(self, history: Sequence[int], most: int) -> list[int]:
        """The drafts the next step carries: at most ``most``."""
        return self.drafts(history, self.length_for(most))

    def observe(self, tokens: int, seconds: float, drafted: int, kept: int) -> None:
        if self.length is not None:
            self.length.observe(tokens, seconds, drafted, kept)

    def prepare(self, history: Sequence[int]) -> None:
        """A stateful drafter catches up with ``history`` (where it is more than a token behind)."""
        if isinstance(self.drafter, StatefulDrafter):
            self.drafter.prepare(history)

    def close(self) -> None:
        if isinstance(self.drafter, StatefulDrafter):
            self.drafter.close()
