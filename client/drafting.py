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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from client.config import SPECULATE_CHOICES


class Drafter(Protocol):
    """Proposes the tokens likely to follow ``history`` (prompt and answer so far): at most ``k``, maybe none."""

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...


@runtime_checkable
class Verifier(Protocol):
    """A session that can score every position of a step and forget its last tokens (InferenceSession)."""

    async def forward(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor: ...

    # -> logits[T, V], row i after new_ids[i]
    async def forward_all(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor: ...

    def rewind(self, length: int) -> None: ...  # forget the tokens at positions >= length


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


def make_speculation(speculate: str, draft_tokens: int) -> Speculation | None:
    """A session's speculation as ClientConfig.speculate and draft_tokens say (None for "off")."""
    if speculate == "off":
        return None
    if speculate == "lookup":
        return Speculation(PromptLookup(), draft_tokens)
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


@dataclass
class Speculation:
    """How a session speculates, and its counters: steps that carried drafts, drafted and accepted tokens."""

    drafter: Drafter
    draft_tokens: int  # most drafts per step
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
