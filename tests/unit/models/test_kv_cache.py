"""The paged KV cache: blocks taken as tokens come, idle sessions evicted in order, never a stepping one."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import CapacityError, SessionError, SessionEvicted
from swarm.models import Step
from swarm.models.kv_cache import KVCache
from swarm.types import LayerRange

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cache(blocks: int, clock: Clock) -> KVCache:
    return KVCache(LayerRange(0, 2), blocks * 16, clock=clock)


def _fill(cache: KVCache, session_id: str, tokens: int, clock: Clock, at_s: float) -> None:
    clock.now = at_s
    cache.open(session_id, 1000 if cache.cache_tokens >= 1000 else cache.cache_tokens)
    cache.prepare({session_id: tokens})


def test_the_session_idle_longest_for_the_tokens_it_holds_goes_first() -> None:
    clock = Clock()
    cache = _cache(8, clock)
    _fill(cache, "big-idle", 64, clock, 100.0)  # 4 blocks, idle 20 s at 120: 20 / 64 tokens
    _fill(cache, "small-idle", 1, clock, 110.0)  # 1 block, idle 10 s: 10 / 16 tokens, more per token
    _fill(cache, "decoding", 16, clock, 119.95)  # a step 50 ms ago: 0.05 / 16 tokens
    clock.now = 120.0
    order = [s.session_id for s in cache.eviction_order()]
    assert order == ["small-idle", "big-idle", "decoding"]
    assert cache.available_tokens == 2 * 16 + 80  # free, and held by sessions idle a second or more
    # 2 free blocks; a newcomer needing 3 evicts the first in order only
    cache.open("new", 100)
    cache.prepare({"new": 48})
    assert cache.get("small-idle").evicted and not cache.get("big-idle").evicted
    assert cache.get("new").held_tokens == 48 and cache.free_tokens == 0 and cache.evictions == 1
    # one more block: big-idle goes too; the decoding session stays
    cache.prepare({"new": 49})
    assert cache.get("big-idle").evicted and not cache.get("decoding").evicted
    assert cache.free_tokens == 48
    # a batch's own sessions are never taken for it: with decoding in the batch, 10 blocks cannot be had
    with pytest.raises(CapacityError, match="KV cache full"):
        cache.prepare({"new": 160, "decoding": 17})
    assert not cache.get("decoding").evicted and cache.get("new").held_tokens == 64  # nothing changed
    assert cache.get("decoding").held_tokens == 16


def test_an_evicted_session_is_told_so_and_starts_afresh_at_position_0(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    blocks = tiny_source.load_blocks(0, 2, cache_tokens=32)  # 2 blocks
    blocks.cache = KVCache(blocks.range, 32, clock=clock)
    prompt = head.embed(torch.tensor(PROMPT))
    blocks.open_session("idle", 32)
    first = blocks.forward([Step("idle", prompt, 0, 2, 0)])[0]
    clock.now += 5.0
    blocks.open_session("busy", 32)
    blocks.forward([Step("busy", head.embed(torch.tensor(PROMPT * 3)), 0, 2, 0)])  # 27 tokens: both blocks
    assert blocks.cache.get("idle").evicted and blocks.session_length("idle", 0) == 0
    with pytest.raises(SessionEvicted, match="evicted") as evicted:
        blocks.forward([Step("idle", prompt[:1], 0, 2, len(PROMPT))])
    assert isinstance(evicted.value, SessionError)  # a client that knows only SessionError replays
    clock.now += 5.0  # busy idles in turn; idle's replay from 0 takes its blocks back, same result
    again = blocks.forward([Step("idle", prompt, 0, 2, 0)])[0]
    assert torch.equal(first, again) and not blocks.cache.get("idle").evicted
    assert blocks.cache.get("busy").evicted


def test_carried_sessions_keep_their_tokens_in_the_new_ranges_blocks(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    """A range that grows carries its sessions over: their blocks copied into its pool, the steps that follow
    giving what they would have on the old range."""
    old, new, check = (tiny_source.load_blocks(a, b, cache_tokens=64) for a, b in [(2, 4), (0, 4), (2, 4)])
    prompt = head.embed(torch.tensor(PROMPT * 2))
    for blocks in (old, check):
        blocks.open_session("s", 64)
        blocks.forward([Step("s", prompt, 2, 4, 0)])
    assert new.carry_sessions(old) == ["s"]
    assert old.cache.free_tokens == 64 and new.cache.free_tokens == 32
    token = head.embed(torch.tensor([7]))
    assert torch.equal(
        new.forward([Step("s", token, 2, 4, 18)])[0], check.forward([Step("s", token, 2, 4, 18)])[0]
    )
    new.close_session("s")
    assert new.cache.free_tokens == 64


@pytest.fixture()
def head(tiny_source):  # type: ignore[no-untyped-def]
    return tiny_source.load_head()


def test_prompts_with_a_common_prefix_share_its_full_blocks_copy_on_write(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    """With sharing on, a second prompt with the same first 40 tokens shares their 2 full blocks (and their
    outputs) and computes only the rest: the same outputs as without sharing, then and after either session
    rewinds into the shared blocks (each writes its own copy, the other's cache stays as it was)."""
    shared, alone = (tiny_source.load_blocks(0, 6, cache_tokens=256) for _ in range(2))
    shared.cache.share_prefixes = True
    system = [(i * 37) % 300 for i in range(40)]
    prompts = {"a": system + [5, 6, 7], "b": system + [9, 8]}

    def both(sid: str, ids: list[int], position: int) -> torch.Tensor:
        hidden = head.embed(torch.tensor(ids))
        got, expected = (r.forward([Step(sid, hidden, 0, 6, position)])[0] for r in (shared, alone))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return got

    for sid, ids in prompts.items():
        shared.open_session(sid, 128)
        alone.open_session(sid, 128)
        both(sid, ids, 0)
    cache = shared.cache
    assert (cache.prefix_tokens_looked_up, cache.prefix_tokens_shared) == (43 + 42, 32)
    assert cache.used_tokens == 4 * 16  # a: 3 blocks; b: its third block, the first two a's
    assert cache.get("a").blocks[:2] == cache.get("b").blocks[:2]
    both("b", [11], 42)
    both("b", [1, 2, 3], 20)  # b rewinds into the second shared block: it gets a copy of its own
    assert cache.get("a").blocks[1] != cache.get("b").blocks[1]
    both("a", [13], 43)  # a's cache is untouched
    both("a", [4, 4], 10)  # and a rewinds into the first block, still shared with b
    both("b", [12], 23)
    shared.close_session("a")
    shared.close_session("b")
    assert cache.free_tokens == 256
    # what a and b rewrote is no longer offered; the two blocks of the common prefix, which nobody rewrote, are
    # (a let go of the second when it rewound before it), free but taken last
    assert len(cache.pool.cached) == 2
    assert set(cache.pool.cached) == set(cache.pool.index.values()) == set(cache.pool.outputs)


def test_a_closed_sessions_prefix_is_shared_until_its_blocks_are_needed(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    """A chat's system prompt outlives the chat: its blocks count as free but are taken last, and a later prompt
    with the same start shares them; once the pool needs them they are plain blocks again."""
    blocks = tiny_source.load_blocks(0, 2, cache_tokens=8 * 16)
    blocks.cache.share_prefixes = True
    pool = blocks.cache.pool
    system = head.embed(torch.tensor([(i * 13) % 300 for i in range(48)]))
    blocks.open_session("first", 64)
    first = blocks.forward([Step("first", system, 0, 2, 0)])[0]
    blocks.close_session("first")
    assert blocks.cache.free_tokens == 8 * 16 and len(pool.cached) == 3
    blocks.open_session("later", 64)
    later = blocks.forward([Step("later", torch.cat([system, head.embed(torch.tensor([7]))]), 0, 2, 0)])[0]
    assert blocks.cache.prefix_tokens_shared == 48
    torch.testing.assert_close(later[:48], first)
    blocks.close_session("later")
    offered = set(pool.index)
    blocks.open_session("big", 8 * 16)
    blocks.forward([Step("big", head.embed(torch.tensor([3] * (8 * 16))), 0, 2, 0)])  # needs every block
    assert not offered & pool.index.keys() and not pool.cached and blocks.cache.free_tokens == 0


def test_a_rewound_block_is_not_offered_with_what_it_held_before(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    """A session that rewinds into a full block it alone holds writes new tokens there: a later session whose
    inputs match the block's old tokens must not get them (its outputs equal a cache without sharing)."""
    shared, alone = (tiny_source.load_blocks(0, 2, cache_tokens=16 * 16) for _ in range(2))
    shared.cache.share_prefixes = True
    ids = [(i * 29) % 300 for i in range(64)]
    shared.open_session("a", 128)
    shared.forward([Step("a", head.embed(torch.tensor(ids[:48])), 0, 2, 0)])  # blocks 0-2 offered
    shared.forward([Step("a", head.embed(torch.tensor([1] * 8)), 0, 2, 40)])  # rewound into block 2
    hidden = head.embed(torch.tensor(ids))
    for blocks in (shared, alone):
        blocks.open_session("b", 128)
    got, expected = (b.forward([Step("b", hidden, 0, 2, 0)])[0] for b in (shared, alone))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert shared.cache.prefix_tokens_shared == 32  # blocks 0 and 1 only


def test_a_session_with_a_step_running_is_never_evicted() -> None:
    """The prefill lane's chunk of a session may run while the decode lane's thread needs blocks: however idle
    that session looks by its last step's time, it keeps its blocks until its call ends."""
    clock = Clock()
    cache = _cache(4, clock)
    _fill(cache, "chunk", 48, clock, 100.0)  # 3 blocks, its call began at 100 s
    _fill(cache, "decoder", 1, clock, 130.0)
    clock.now = 131.0
    with cache.stepping(["chunk"]):
        with pytest.raises(CapacityError):
            cache.prepare({"decoder": 40})  # needs 2 more blocks: only the running chunk's could give them
        assert cache.get("chunk").held_tokens == 48 and cache.evictions == 0
    cache.prepare({"decoder": 40})  # once its call has ended, it is the one to go
    assert cache.get("chunk").held_tokens == 0 and cache.evictions == 1


def test_copy_on_write_without_room_changes_nothing(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    """A rewind into shared blocks needs a copy of each; with room for only some of them the step fails and
    every block keeps its holders: closing the one session then frees none of the other's blocks."""
    blocks = tiny_source.load_blocks(0, 2, cache_tokens=5 * 16)
    blocks.cache.share_prefixes = True
    pool = blocks.cache.pool
    prompt = head.embed(torch.tensor([(i * 31) % 300 for i in range(40)]))
    for sid in ("a", "b"):
        blocks.open_session(sid, 64)
        blocks.forward([Step(sid, prompt, 0, 2, 0)])  # b shares a's first 2 blocks: 4 blocks used, 1 free
    assert blocks.cache.get("a").blocks[:2] == blocks.cache.get("b").blocks[:2] and pool.free_blocks == 1
    # b rewinds layer 0 only (a route may cut the range) into block 0: both shared blocks need copies, while
    # a has a step running (it cannot be evicted for them)
    with blocks.cache.stepping(["a"]), pytest.raises(CapacityError):
        blocks.forward([Step("b", head.embed(torch.tensor([1])), 0, 1, 5)])
    held_by_a = blocks.cache.get("a").blocks
    blocks.close_session("b")
    assert all(pool.refs[block] == 1 for block in held_by_a)
    assert pool.free_blocks == 5 - len(held_by_a)
