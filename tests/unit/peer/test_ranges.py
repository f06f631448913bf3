"""Make before break on one peer: a grown range carries its sessions over (exact greedy tokens, shared layers,
same keys), a moved peer announces its older ranges while their sessions last and drops each one when its
sessions end (the grace is only a safety bound), and routing still sends new sessions to the current range."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch

from client.routes import peer_state
from swarm.errors import CapacityError, SessionError
from swarm.models.blocks import BlockRange, Step
from swarm.peer.config import FollowConfig
from swarm.peer.follow import PlanFollower, assemble_blocks, move_budget, resident_layers
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Peer
from swarm.types import LayerRange
from swarm.wire import CloseRequest, StepRequest
from tests.unit.peer.test_follow import _Directory, _peer, plan_record, snapshot
from tests.unit.peer.test_handlers import run_peers

pytestmark = pytest.mark.timeout(60)

R = LayerRange
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300]


def _run(peer: Peer, body: Callable[[], Awaitable[None]]) -> None:
    run_peers([peer], body)


async def _until(peer: Peer, done: Callable[[], bool]) -> None:
    """Wait for ``done()``, re-checking each time the peer's record changes (serve, drop, accepting)."""
    async with asyncio.timeout(30):
        while not done():
            peer.changed.clear()
            await peer.changed.wait()


def _follower(
    peer: Peer, directory: _Directory, source, announced: list[LayerRange], **config
) -> PlanFollower:  # type: ignore[no-untyped-def]
    async def announce() -> None:
        assert peer.held is not None
        announced.append(peer.held)

    return PlanFollower(
        peer=peer,
        directory=directory,  # type: ignore[arg-type]
        source=source,
        announce=announce,
        config=FollowConfig(check_interval_s=0.01, handover_timeout_s=60, **config),
    )


def test_a_grown_range_keeps_its_sessions_exactly(tiny_source):
    """QmA serves 1:3 of a session whose other layers run locally; mid-answer the plan grows QmA to 0:4. The
    session carries over (same key, same cache, steps still naming 1:3), the shared layers are not reloaded,
    the old range is gone at once, and the greedy tokens equal transformers'."""
    spec = tiny_source.spec
    reference = tiny_source.load_reference_model()
    reference.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])
    new_tokens = 12
    expected = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
    )[0, len(PROMPT) :].tolist()
    head = tiny_source.load_head()
    before, after = (
        tiny_source.load_blocks(0, 1, cache_tokens=64),
        tiny_source.load_blocks(3, 6, cache_tokens=64),
    )
    for local in (before, after):
        local.open_session("s", 32)
    peer = _peer(tiny_source.load_blocks(1, 3, "cpu", "float32", 256), "QmA", max_layers=4)
    held_modules = list(peer.ranges[0].blocks.layers)
    handlers = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]
    plan = plan_record(1, {"QmA": R(0, 4)})
    announced: list[LayerRange] = []
    follower = _follower(peer, _Directory("QmA", snapshot(plan, ("QmA", 1, 3))), tiny_source, announced)

    async def next_token(tokens: list[int], position: int) -> int:
        hidden = before.forward([Step("s", head.embed(torch.tensor(tokens)), 0, 1, position)])[0]
        request = StepRequest("s", position, hidden, 1, 3, 32, spec.weights_hash)
        hidden = (await handlers.rpc_step(request, "client")).hidden  # type: ignore[union-attr]
        hidden = after.forward([Step("s", hidden, 3, 6, position)])[0]
        return int(head.logits(hidden)[-1].argmax())

    async def body() -> None:
        got = [await next_token(PROMPT, 0)]
        while len(got) < 4:
            got.append(await next_token(got[-1:], len(PROMPT) + len(got) - 1))
        served = peer.current
        await asyncio.wait_for(follower.check(), 30)  # nothing to wait for: the move is done at once
        assert announced == [R(0, 4)] and follower.moves == 1
        assert [s.range for s in peer.ranges] == [R(0, 4)] and peer.current is served
        assert served is not None and list(served.sessions) == ["s@client"]
        assert served.blocks.active_sessions == ["s@client"]
        assert all(a is b for a, b in zip(served.blocks.layers[1:3], held_modules, strict=True))  # shared
        assert peer.record().older_ranges == []
        while len(got) < new_tokens:
            got.append(await next_token(got[-1:], len(PROMPT) + len(got) - 1))
        assert got == expected
        # A new session opens on the grown range and runs all of it.
        request = StepRequest("s2", 0, torch.randn(3, spec.hidden_size), 0, 4, 32, spec.weights_hash)
        assert (await handlers.rpc_step(request, "client")).hidden.shape == (3, spec.hidden_size)  # type: ignore[union-attr]

    _run(peer, body)


def test_a_step_queued_on_the_old_blocks_still_runs_after_the_carry_over(tiny_source):
    """The old BlockRange keeps pointing at the carried caches: a step that was queued on it before the swap
    writes where the next step on the new blocks reads, and both equal one range that never moved."""
    spec = tiny_source.spec
    hidden = torch.randn(8, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    old = tiny_source.load_blocks(1, 3, cache_tokens=256)
    steady = tiny_source.load_blocks(1, 3, cache_tokens=256)
    for blocks in (old, steady):
        blocks.open_session("s", 16)
        blocks.forward([Step("s", hidden[:5], 1, 3, 0)])
    grown = assemble_blocks(tiny_source, old, R(0, 4))
    assert grown.carry_sessions(old) == ["s"] and grown.free_cache_tokens == 256 - 16
    (a,) = old.forward([Step("s", hidden[5:6], 1, 3, 5)])  # queued on the old blocks before the swap
    (b,) = grown.forward([Step("s", hidden[6:8], 1, 3, 6)])  # the next step, on the grown range
    (x,) = steady.forward([Step("s", hidden[5:6], 1, 3, 5)])
    (y,) = steady.forward([Step("s", hidden[6:8], 1, 3, 6)])
    assert torch.equal(a, x) and torch.equal(b, y)
    assert grown.session_length("s", 0) == 0 and grown.session_length("s", 2) == 8  # the new layer is empty


def test_carrying_sessions_over_checks_containment_and_budget(tiny_source):
    old = tiny_source.load_blocks(1, 3, cache_tokens=256)
    for sid in ("a", "b"):  # 80 tokens each: 5 blocks
        old.open_session(sid, 100)
        old.forward([Step(sid, torch.randn(80, tiny_source.spec.hidden_size), 1, 3, 0)])
    with pytest.raises(ValueError, match="does not contain"):
        assemble_blocks(tiny_source, old, R(2, 4)).carry_sessions(old)
    held = list(old.layers)
    small = BlockRange(tiny_source.spec, tiny_source.config, held, R(1, 3), 150, old.device, old.dtype)
    with pytest.raises(CapacityError):
        small.carry_sessions(old)
    assert small.active_sessions == [] and small.free_cache_tokens == 144  # none carried half-way (9 blocks)
    assert old.cache.get("a").layers == R(1, 3)


def test_old_range_is_announced_and_dropped_when_its_sessions_end(tiny_source):
    """QmA moves 0:2 -> 4:6 (disjoint: make before break). The move finishes while s1 is still open on 0:2;
    the record announces 0:2 under older_ranges, routing still sees only 4:6, and 0:2 goes when s1 closes,
    with an hour of grace left."""
    spec = tiny_source.spec
    peer = _peer(tiny_source.load_blocks(0, 2, "cpu", "float32", 256), "QmA", max_layers=2)
    handlers = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]
    plan = plan_record(1, {"QmA": R(4, 6), "QmB": R(0, 2)})
    announced: list[LayerRange] = []
    directory = _Directory("QmA", snapshot(plan, ("QmA", 0, 2), ("QmB", 0, 2)))
    follower = _follower(peer, directory, tiny_source, announced, session_grace_s=3600)
    hidden = torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(3))

    def step(sid: str, position: int, tokens: int, start: int, end: int) -> StepRequest:
        return StepRequest(sid, position, hidden[:tokens], start, end, 32, spec.weights_hash)

    async def body() -> None:
        await handlers.rpc_step(step("s1", 0, 3, 0, 2), "client")
        await asyncio.wait_for(follower.check(), 30)  # done although s1 is still open on 0:2
        assert announced == [R(4, 6)] and [s.range for s in peer.ranges] == [R(0, 2), R(4, 6)]
        record = peer.record()
        assert (record.range_start, record.range_end) == (4, 6)
        assert [(o.start, o.end, o.sessions) for o in record.older_ranges] == [(0, 2, 1)]
        assert type(record).from_dht(record.to_dht()) == record
        assert peer_state(record, 0.9).layers == R(4, 6)  # new sessions are routed to 4:6 only
        with pytest.raises(CapacityError, match="holds 4:6|4, 6"):
            await handlers.rpc_step(step("s2", 0, 3, 0, 2), "client")  # no new session on 0:2
        await handlers.rpc_step(step("s1", 3, 1, 0, 2), "client")  # s1 keeps running there
        await handlers.rpc_close(CloseRequest("s1"), "client")  # it ends (or moved away and was closed)
        await asyncio.wait_for(follower.retired(), 30)
        assert [s.range for s in peer.ranges] == [R(4, 6)] and peer.record().older_ranges == []

    _run(peer, body)


def test_the_grace_is_only_a_safety_bound(tiny_source):
    """With no grace left, the old range goes at once and its open session's next step is refused (the client
    replays it elsewhere)."""
    spec = tiny_source.spec
    peer = _peer(tiny_source.load_blocks(0, 2, "cpu", "float32", 256), "QmA", max_layers=2)
    handlers = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]
    plan = plan_record(1, {"QmA": R(4, 6), "QmB": R(0, 2)})
    directory = _Directory("QmA", snapshot(plan, ("QmA", 0, 2), ("QmB", 0, 2)))
    follower = _follower(peer, directory, tiny_source, [], session_grace_s=0)
    hidden = torch.randn(4, spec.hidden_size)

    async def body() -> None:
        await handlers.rpc_step(StepRequest("s1", 0, hidden[:3], 0, 2, 32, spec.weights_hash), "client")
        await asyncio.wait_for(follower.check(), 30)
        await asyncio.wait_for(follower.retired(), 30)
        assert [s.range for s in peer.ranges] == [R(4, 6)]
        with pytest.raises(SessionError):
            await handlers.rpc_step(StepRequest("s1", 3, hidden[3:], 0, 2, 32, spec.weights_hash), "client")

    _run(peer, body)


def test_resident_layers_and_move_budget():
    assert resident_layers(R(0, 3), R(2, 4), R(0, 4)) == 4  # the hull
    assert resident_layers(R(0, 3), R(2, 4), R(2, 4)) == 4  # direct: old + the target's other layer
    assert resident_layers(R(0, 2), R(4, 6), R(4, 6)) == 4
    assert move_budget(R(0, 2), R(1, 3), max_layers=2, max_move_layers=0) == 4  # default: old + new
    assert move_budget(R(0, 2), R(1, 3), max_layers=6, max_move_layers=0) == 6
    assert move_budget(R(0, 3), R(1, 3), max_layers=3, max_move_layers=2) == 3  # never below either range


def test_a_move_over_the_memory_budget_goes_in_steps(tiny_source):
    """QmA moves 0:2 -> 1:3 with room for 2 layers during moves: it narrows to 1:2 (no load), keeps 0:2 only
    for s1 until s1 ends, then loads layer 2 alone and carries 1:2's sessions over. At no point does it hold
    more than 2 layers' modules."""
    spec = tiny_source.spec
    peer = _peer(tiny_source.load_blocks(0, 2, "cpu", "float32", 256), "QmA", max_layers=2)
    layer1 = peer.ranges[0].blocks.layers[1]
    handlers = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]
    plan = plan_record(1, {"QmA": R(1, 3), "QmB": R(0, 1)})
    announced: list[LayerRange] = []
    directory = _Directory("QmA", snapshot(plan, ("QmA", 0, 2), ("QmB", 0, 1)))
    follower = _follower(peer, directory, tiny_source, announced, max_move_layers=2)
    hidden = torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(4))

    def step(sid: str, position: int, tokens: int, start: int, end: int) -> StepRequest:
        return StepRequest(sid, position, hidden[:tokens], start, end, 32, spec.weights_hash)

    def modules_held() -> int:
        return len({id(m) for s in peer.ranges for m in s.blocks.layers})

    async def body() -> None:
        await handlers.rpc_step(step("s1", 0, 3, 0, 2), "client")
        move = asyncio.create_task(follower.check())
        await _until(peer, lambda: peer.held == R(1, 2))
        assert peer.held == R(1, 2) and [s.range for s in peer.ranges] == [R(0, 2), R(1, 2)]
        assert modules_held() == 2 and not move.done()
        await handlers.rpc_step(step("s2", 0, 3, 1, 2), "client")  # opens on the narrowed range
        await handlers.rpc_step(step("s1", 3, 1, 0, 2), "client")  # s1 still runs on 0:2
        await handlers.rpc_close(CloseRequest("s1"), "client")
        await asyncio.wait_for(move, 30)
        assert announced == [R(1, 2), R(1, 3)] and [s.range for s in peer.ranges] == [R(1, 3)]
        assert peer.ranges[0].blocks.layers[0] is layer1 and modules_held() == 2
        assert list(peer.ranges[0].sessions) == ["s2@client"]  # carried over to 1:3
        await handlers.rpc_step(step("s2", 3, 1, 1, 2), "client")

    _run(peer, body)


def test_a_disjoint_move_over_the_budget_loads_only_after_the_old_range_went(tiny_source):
    """0:2 -> 4:6 with room for 2 layers: once others keep 0:2, QmA takes no new sessions, serves s1 to its
    end (announced as an older range, no current one), then loads 4:6."""
    spec = tiny_source.spec
    peer = _peer(tiny_source.load_blocks(0, 2, "cpu", "float32", 256), "QmA", max_layers=2)
    handlers = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]
    plan = plan_record(1, {"QmA": R(4, 6), "QmB": R(0, 2)})
    announced: list[LayerRange] = []
    directory = _Directory("QmA", snapshot(plan, ("QmA", 0, 2), ("QmB", 0, 2)))
    follower = _follower(peer, directory, tiny_source, announced, max_move_layers=2)
    hidden = torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(5))

    async def body() -> None:
        await handlers.rpc_step(StepRequest("s1", 0, hidden[:3], 0, 2, 32, spec.weights_hash), "client")
        move = asyncio.create_task(follower.check())
        await _until(peer, lambda: peer.current is None)
        record = peer.record()
        assert (record.range_start, record.range_end) == (0, 0) and not move.done()
        assert [(o.start, o.end, o.sessions) for o in record.older_ranges] == [(0, 2, 1)]
        with pytest.raises(CapacityError):
            await handlers.rpc_step(StepRequest("s2", 0, hidden[:3], 0, 2, 32, spec.weights_hash), "client")
        await handlers.rpc_close(CloseRequest("s1"), "client")
        await asyncio.wait_for(move, 30)
        assert announced == [R(4, 6)] and [s.range for s in peer.ranges] == [R(4, 6)]

    _run(peer, body)
