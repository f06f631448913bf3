"""Text generation over an InferenceSession: the decode loop, incremental detokenizing and stop strings.

Nothing here knows about the network; the same loop runs over the remote chain of peers and over the
in-process chain (client.local) the unit tests and benchmarks use, which is how the tests prove it equals
transformers' own generate.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from client.drafting import Speculation, Target, Verifier, accept, sampled_accept

Pick = Callable[[torch.Tensor, Sequence[int]], int]  # (logits[V], token ids so far) -> next token id


class Forward(Protocol):
    # -> logits[V] after the last id; with argmax_only, only their argmax is sure to be exact (a greedy pick)
    async def forward(self, new_ids: Sequence[int], argmax_only: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt token ids, a length bound, the ids and strings that end generation."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    eos_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    yield_eos: bool = False  # transformers' generate returns the EOS token; text output leaves it out

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


async def generate_ids(
    session: Forward,
    request: GenerationRequest,
    pick: Pick,
    argmax_only: bool = False,
    speculation: Speculation | None = None,
    target: Target | None = None,
) -> AsyncGenerator[int, None]:
    """Yield new token ids as they are sampled; stops at an EOS id or after max_new_tokens.

    The prompt goes through the swarm as one prefill step, then each sampled token as one decode step; the
    last sampled token is never sent, since nothing would read its output. ``argmax_only`` says that `pick`
    reads only the argmax of the logits (greedy, SamplingParams.greedy): the head may then skip the rest, and
    ``speculation``, if given, drafts tokens to verify several in one step. ``target`` is the sampler `pick`
    draws from: with it, drafts are verified when sampling too (a greedy pick does not need it).
    """
    if speculation is not None and (argmax_only or target is not None) and isinstance(session, Verifier):
        # drafts with a greedy pick, or with the sampler `target` that `pick` draws from (client.drafting)
        spec_tokens = speculative_ids(session, request, pick, speculation, argmax_only, target)
        async with aclosing(spec_tokens) as tokens:
            async for token in tokens:
                yield token
        return
    if request.max_new_tokens == 0:
        return
    history = list(request.prompt_ids)
    logits = await session.forward(request.prompt_ids, argmax_only)
    for i in range(request.max_new_tokens):
        token = pick(logits, history)
        if token in request.eos_ids:
            if request.yield_eos:
                yield token
            return
        history.append(token)
        yield token
        if i + 1 < request.max_new_tokens:
            logits = await session.forward([token], argmax_only)


async def speculative_ids(
    session: Verifier,
    request: GenerationRequest,
    pick: Pick,
    spec: Speculation,
    argmax_only: bool = True,
    target: Target | None = None,
) -> AsyncGenerator[int, None]:
    """`generate_ids` with drafts, stopping at an EOS id or after max_new_tokens exactly; fewer trips where
    the drafter guesses right. Without ``target``, the same tokens as plain greedy decoding (``pick`` must be
    deterministic); with it (``pick`` is its sample), tokens drawn as plain sampling draws them
    (client.drafting.sampled_accept)."""
    if request.max_new_tokens == 0:
        return
    try:
        async with aclosing(_speculative_ids(session, request, pick, spec, argmax_only, target)) as tokens:
            async for token in tokens:
                yield token
    finally:
        spec.close()  # a model drafter's cache (client.draft_model)


async def _speculative_ids(
    session: Verifier,
    request: GenerationRequest,
    pick: Pick,
    spec: Speculation,
    argmax_only: bool,
    target: Target | None,
) -> AsyncGenerator[int, None]:
    history = list(request.prompt_ids)
    logits = await session.forward(request.prompt_ids, argmax_only)
    spec.prepare(history)
    token = pick(logits, history)
    emitted = 0
    while True:
        if token in request.eos_ids:
            if request.yield_eos:
                yield token
            return
        history.append(token)
        yield token
        emitted += 1
        remaining = request.max_new_tokens - emitted
        if remaining == 0:
            return
        # a fully accepted step yields its drafts and one more token: never past max_new_tokens
        k = spec.length_for(remaining - 1)
        if k > 0:  # a model drafter that sat out steps catches up first: a one-off, not this step's cost
            spec.prepare(history[:-1])
        started = spec.clock()  # a step's time counts its drafting: a model drafter's is not free
        drafts = spec.drafts(history, k)
        if not drafts:
            logits = await session.forward([token], argmax_only)
            spec.observe(1, spec.clock() - started, 0, 0)
            token = pick(logits, history)
            continue
        position = len(history) - 1  # where `token` goes: the session holds history[:-1]
        rows = await session.forward_all([token, *drafts], argmax_only)  # [k + 1, V]
        step_s = spec.clock() - started
        if target is not None:
            kept = sampled_accept(drafts, rows, history, target)
        else:
            picks: list[int] = []
            for i in range(len(drafts) + 1):
                picks.append(pick(rows[i], [*history, *drafts[:i]]))
                if i < len(drafts) and picks[i] != drafts[i]:
                    break
            kept = accept(drafts, picks)
        session.rewind(position + len(kept))  # the session now holds history[:-1], token, kept[:-1]
        spec.observe(len(drafts) + 1, step_s, len(drafts), len(kept) - 1)
        spec.steps += 1
        spec.drafted += len(drafts)
        spec.accepted += len(kept) - 1
        for t in kept[:-1]:  # accepted drafts, each checked like a plain pick
            if t in request.eos_ids:
                if request.yield_eos:
                    yield t
                return
            history.append(t)
            yield t
            emitted += 1
        token = kept[-1]


async def timed_ids(
    session: Forward, request: GenerationRequest, pick: Pick, argmax_only: bool = False
) -> tuple[list[int], list[float]]:
    """The tokens of `generate_ids`, and perf_counter times: before the prefill, then as each token arrives.

    For the benchmarks, so they time the same decode loop the client runs: prefill takes times[1] - times[0],
    the decode steps times[-1] - times[1].
    """
    tokens, times = [], [time.perf_counter()]
    async with aclosing(generate_ids(session, request, pick, argmax_only)) as stream:
        async for token in stream:
            times.append(time.perf_counter())
            tokens.append(token)
    return tokens, times


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces without splitting multi-byte characters.

    Byte-level BPE can spread one character over several tokens; decoding them one at a time would give
    U+FFFD halves. We decode a short window of recent tokens twice, with and without the newest ones, and
    emit only the new tail once it no longer ends in a replacement character.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding from here gives stable text for ids[prefix:read]
        self._read = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """Holds back text that could be the start of a stop string; reports when one is complete.

    `push(piece)` returns (text safe to emit, stopped). After a stop, the text up to the stop string is emitted
    and the stop string itself is dropped, like the OpenAI API does.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        text = self._held + piece
        if not self.stop:
            return text, False
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            at = min(hits)[0]
            self._held = ""
            return text[:at], True
        keep = max((_overlap(text, s) for s in self.stop), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


async def generate_text(
    session: Forward,
    request: GenerationRequest,
    pick: Pick,
    tokenizer: Any,
    argmax_only: bool = False,
    speculation: Speculation | None = None,
    target: Target | None = None,
    on_token: Callable[[int], None] = lambda token: None,
) -> AsyncGenerator[str, None]:
    """Yield text pieces as tokens arrive; stop strings end generation and are not yielded. ``on_token`` is
    told each token as it arrives (with drafts, several come from one step)."""
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopMatcher(request.stop)
    async with aclosing(generate_ids(session, request, pick, argmax_only, speculation, target)) as tokens:
        async for token in tokens:
            on_token(token)
            text, stopped = stops.push(detok.push(token))
            if text:
                yield text
            if stopped:
                return
    text, stopped = stops.push(detok.flush())
    if not stopped:
        text += stops.flush()
    if text:
        yield text
