"""How a session cuts a long step into chunks that the route's peers pipeline (HPipe), and sends them.

A prompt sent as consecutive chunks at once lets peer k compute chunk i while peer k+1 computes chunk i-1, so
the route's peers work on one prompt together instead of each waiting for the whole of it; a failover's replay
is cut the same way. Peers run a session's steps in position order whatever order they arrive in
(swarm/peer/executor.py).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from swarm.models.kv_cache import BLOCK_TOKENS

T = TypeVar("T")

# Where a token's attention (over the tokens before it) costs as much as the rest of its layer, in positions:
# chunks of a pipelined prompt are cut to cost the same, so later ones hold fewer tokens. SmolLM2-135M counts
# 7.1 MFLOP per token per layer outside attention and 2.3 kFLOP per earlier token in it: 3,000 (measured chunk
# times agree roughly: scripts/bench_prefill.py --chunk-costs, docs/benchmarks.md). Equal-cost chunks keep the
# pipeline's stages in step; the last chunk, which no other work overlaps, is the cheapest in tokens.
ATTENTION_COST_TOKENS = 3000


def prefill_chunks(
    tokens: int,
    position: int,
    chunk_tokens: int,
    attention_tokens: int = ATTENTION_COST_TOKENS,
    align: int = 1,
) -> list[int]:
    """Sizes of the chunks that ``tokens`` new tokens after ``position`` are pipelined in: one chunk per
    ``chunk_tokens`` on average (0: one chunk), each of the same estimated cost, a token at position x costing
    1 + x / attention_tokens; with ``align``, chunks of a block or more end on multiples of it (the peers' KV
    block size: a chunk that starts on a block can share a common prefix's blocks, swarm.models.kv_cache)."""
    count = -(-tokens // chunk_tokens) if chunk_tokens > 0 else 1
    if count <= 1:
        return [tokens]

    def cost(x: float) -> float:  # of positions [position, x)
        return (x - position) + (x * x - position * position) / (2 * attention_tokens)

    step = cost(position + tokens) / count
    base = position + position * position / (2 * attention_tokens)
    ends: list[int] = []
    for k in range(1, count):
        # solve x + x^2 / 2A = base + k * step for x
        x = attention_tokens * (math.sqrt(1 + 2 * (base + k * step) / attention_tokens) - 1)
        ends.append(min(position + tokens - (count - k), max(round(x), (ends[-1] if ends else position) + 1)))
    if align > 1 and tokens >= count * align:  # chunks smaller than a block are left as they are
        aligned = {round(end / align) * align for end in ends}
        ends = sorted(end for end in aligned if position < end < position + tokens)
    bounds = [position, *ends, position + tokens]
    return [b - a for a, b in itertools.pairwise(bounds)]


async def chunked(
    tokens: int, position: int, chunk_tokens: int, send: Callable[[int, int], Awaitable[T]]
) -> list[T]:
    """``send(start, size)`` for each chunk of ``tokens`` tokens after ``position`` (one for a decode step or
    a short prompt), all at once; their answers in order.

    A failed chunk fails them all: we wait for every chunk's answer first (the chunks queued behind a
    failed one fail at once), so no chunk of this attempt is still at work when the failover replays the
    prefix, and raise the first chunk's error, the cause of the others'."""
    sizes = prefill_chunks(tokens, position, chunk_tokens, align=BLOCK_TOKENS)
    if len(sizes) == 1:
        return [await send(0, tokens)]
    starts = [0, *itertools.accumulate(sizes)]
    answers = await asyncio.gather(
        *(send(start, size) for start, size in zip(starts, sizes, strict=False)), return_exceptions=True
    )
    error = next((a for a in answers if isinstance(a, BaseException)), None)
    if error is not None:
        raise error
    return [a for a in answers if not isinstance(a, BaseException)]
