"""How a long prompt is cut for pipelining (client.chunks.prefill_chunks): pure arithmetic."""

from __future__ import annotations

import itertools

import pytest

from client.chunks import prefill_chunks


@pytest.mark.parametrize(
    ("tokens", "position", "chunk"), [(2048, 0, 256), (512, 0, 256), (300, 7, 64), (5, 0, 1)]
)
def test_chunks_cover_the_prompt_once_and_count_one_per_chunk_tokens(
    tokens: int, position: int, chunk: int
) -> None:
    sizes = prefill_chunks(tokens, position, chunk)
    assert sum(sizes) == tokens and min(sizes) >= 1
    assert len(sizes) == -(-tokens // chunk)


def test_later_chunks_hold_fewer_tokens_for_the_same_cost() -> None:
    """A token's attention grows with its position, so equal-cost chunks shrink; without attention cost
    (a huge attention_tokens) they are equal."""
    sizes = prefill_chunks(2048, 0, 256, attention_tokens=3000)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1.3 * sizes[-1]
    assert prefill_chunks(2048, 0, 256, attention_tokens=10**12) == [256] * 8

    def cost(a: int, b: int) -> float:
        return (b - a) + (b * b - a * a) / 6000

    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    costs = [cost(a, b) for a, b in itertools.pairwise(bounds)]
    assert max(costs) / min(costs) < 1.02


def test_short_prompts_and_no_chunking_go_whole() -> None:
    assert prefill_chunks(37, 0, 256) == [37]
    assert prefill_chunks(1, 500, 256) == [1]
    assert prefill_chunks(4096, 0, 0) == [4096]


@pytest.mark.parametrize(("tokens", "position"), [(437, 0), (2048, 0), (300, 16), (40, 0), (1000, 7)])
def test_aligned_chunks_start_on_a_kv_block(tokens: int, position: int) -> None:
    """With align (the KV block size), every chunk but the first starts on a multiple of it, so a peer can share
    a common prefix's blocks chunk after chunk; the chunks still cover the prompt once, about as many."""
    sizes = prefill_chunks(tokens, position, 128, align=16)
    starts = list(itertools.accumulate(sizes, initial=position))[1:-1]
    assert sum(sizes) == tokens and min(sizes) >= 1 and all(start % 16 == 0 for start in starts)
    assert abs(len(sizes) - len(prefill_chunks(tokens, position, 128))) <= 1
