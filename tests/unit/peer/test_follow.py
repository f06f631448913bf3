"""Following the plan: the pure decisions (which range, via what, who keeps a layer), assembling blocks, and a
follower moving a real executor and handlers through a handover driven by snapshots the test sets."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pydantic
import pytest
import torch

from swarm.dht import PlanRecord, SwarmSnapshot
from swarm.models.blocks import BlockRange, Step
from swarm.peer.config import FollowConfig
from swarm.peer.executor import Executor
from swarm.peer.follow import (
    PlanFollower,
    assemble_blocks,
    dropped_layers,
    planned_range,
    transition_range,
    unkept_layers,
)
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer, Status
from swarm.types import LayerRange, NodeID, Plan
from swarm.wire import CloseRequest, StepRequest
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(60)

R = LayerRange


def plan_record(epoch: int, placement: dict[str, LayerRange], planner: str = "QmA") -> PlanRecord:
    plan = Plan("milp", {NodeID(p): r for p, r in placement.items()}, 10.0, epoch=epoch)
    return PlanRecord(epoch=epoch, planner_peer_id=planner, plan=plan.to_json(), created_at=0.0)


def snapshot(plan: PlanRecord | None, *held: tuple[str, int, int], **changes: Any) -> SwarmSnapshot:
    peers = {pid: peer_record(pid, start, end, **changes) for pid, start, end in held}
    return SwarmSnapshot(peers=peers, plan=plan, planner_peer_id="QmA", fetched_at=0.0)


def test_planned_range_only_for_a_newer_epoch_that_moves_us():
    plan = plan_record(3, {"QmA": R(0, 4), "QmB": R(4, 8)})
    snap = snapshot(plan, ("QmA", 0, 8), ("QmB", 0, 8))
    assert planned_range("QmA", R(0, 8), snap, adopted_epoch=2, num_layers=8) == R(0, 4)
    assert planned_range("QmB", R(0, 8), snap, adopted_epoch=0, num_layers=8) == R(4, 8)
    assert planned_range("QmA", R(0, 8), snap, adopted_epoch=3, num_layers=8) is None  # already adopted
    assert planned_range("QmA", R(0, 4), snap, adopted_epoch=0, num_layers=8) is None  # already there
    assert planned_range("QmC", R(0, 8), snap, adopted_epoch=0, num_layers=8) is None  # not in the plan
    assert planned_range("QmA", R(0, 8), snapshot(None), adopted_epoch=0, num_layers=8) is None
    assert planned_range("QmB", R(0, 2), snap, adopted_epoch=0, num_layers=6) is None  # past the model


def test_malformed_plan_cannot_even_be_a_record():
    # A plan reaches the follower only as a PlanRecord, whose body is validated on every parse.
    with pytest.raises(pydantic.ValidationError):
        PlanRecord(epoch=5, planner_peer_id="QmA", plan={"placement": {"QmA": [4, 2]}}, created_at=0.0)


def test_transition_serves_the_hull_when_it_fits():
    assert transition_range(R(0, 3), R(2, 4), max_layers=4) == R(0, 4)
    # Over max_layers, but no more than holding old and new at once (which the direct path does anyway).
    assert transition_range(R(0, 3), R(2, 4), max_layers=3) == R(0, 4)
    assert transition_range(R(0, 2), R(6, 8), max_layers=2) == R(6, 8)  # far apart: straight to the target
    assert transition_range(R(2, 6), R(3, 5), max_layers=4) == R(
        2, 6
    )  # shrinking: keep all until handed over
    assert transition_range(R(0, 2), R(4, 6), max_layers=6) == R(0, 6)  # disjoint: the gap too, if it fits


def test_peers_swapping_overlapping_ranges_do_not_wait_on_each_other():
    # Seen live with 13-layer peers on a 30-layer model: A 0:13 -> 11:24, B 13:26 -> 0:11, C 17:30 -> 24:30.
    assert transition_range(R(0, 13), R(11, 24), max_layers=13) == R(0, 24)  # A announces the hull at once
    assert transition_range(R(13, 26), R(0, 11), max_layers=13) == R(0, 11)  # B goes direct...
    plan = plan_record(1, {"QmA": R(11, 24), "QmB": R(0, 11), "QmC": R(24, 30)})
    snap = snapshot(plan, ("QmA", 0, 24), ("QmB", 13, 26), ("QmC", 17, 30), num_layers=30)
    assert unkept_layers("QmB", dropped_layers(R(13, 26), R(0, 11)), snap) == []  # ...and need not wait


def test_dropped_layers():
    assert dropped_layers(R(0, 4), R(2, 6)) == [0, 1]
    assert dropped_layers(R(2, 4), R(0, 6)) == []


def test_a_layer_is_kept_only_by_a_peer_that_stays_on_it():
    # A moves 0:4 -> 4:8 and B 4:8 -> 0:4; C is not in the plan.
    plan = plan_record(1, {"QmA": R(4, 8), "QmB": R(0, 4)})
    # B still serves only its old 4:8: nobody keeps A's 0:4 yet.
    snap = snapshot(plan, ("QmA", 0, 4), ("QmB", 4, 8))
    assert unkept_layers("QmA", [0, 1, 2, 3], snap) == [0, 1, 2, 3]
    # B serves the hull 0:8 now: it keeps 0:4 (its planned range), not 4:8 (it is leaving those).
    snap = snapshot(plan, ("QmA", 0, 8), ("QmB", 0, 8))
    assert unkept_layers("QmA", [0, 1, 2, 3], snap) == []
    assert unkept_layers("QmA", [4, 5], snap) == [4, 5]  # A must not count on B for B's old layers
    assert unkept_layers("QmB", [4, 5], snap) == []  # ...but B counts on A, which the plan gives 4:8
    # A peer the plan does not name does not move this epoch: it keeps what it serves.
    snap = snapshot(plan, ("QmA", 0, 4), ("QmC", 2, 6))
    assert unkept_layers("QmA", [0, 1, 2, 3], snap) == [0, 1]
    # Only serving peers count.
    snap = snapshot(plan, ("QmA", 0, 4), ("QmB", 0, 8), state="loading")
    assert unkept_layers("QmA", [0], snap) == [0]


def test_config_checks():
    with pytest.raises(ValueError, match="must be positive"):
        FollowConfig(check_interval_s=0)
    with pytest.raises(ValueError, match="session_grace_s"):
        FollowConfig(session_grace_s=-1)
    with pytest.raises(ValueError, match="max_move_layers"):
        FollowConfig(max_move_layers=-1)


@pytest.mark.parametrize(
    ("held", "target"), [(R(1, 5), R(2, 4)), (R(2, 4), R(1, 5)), (R(0, 2), R(1, 3)), (R(0, 2), R(4, 6))]
)
def test_assembled_blocks_compute_exactly_what_freshly_loaded_ones_do(tiny_source, held, target):
    old = tiny_source.load_blocks(held.start, held.end, "cpu", "float32", 256)
    built = assemble_blocks(tiny_source, old, target)
    fresh = tiny_source.load_blocks(target.start, target.end, "cpu", "float32", 256)
    assert built.range == target and built.cache.cache_tokens == 256
    for layer in range(target.start, target.end):  # held layers are shared, not reloaded
        shared = built.layers[layer - target.start] is (
            old.layers[layer - held.start] if layer in held else None
        )
        assert shared == (layer in held)
    hidden = torch.randn(5, tiny_source.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for blocks in (built, fresh):
        blocks.open_session("s", 16)
    (a,) = built.forward([Step("s", hidden, target.start, target.end, 0)])
    (b,) = fresh.forward([Step("s", hidden, target.start, target.end, 0)])
    assert torch.equal(a, b)
    (a,) = built.forward([Step("s", hidden[:1], target.start, target.end, 5)])  # decode from the cache
    (b,) = fresh.forward([Step("s", hidden[:1], target.start, target.end, 5)])
    assert torch.equal(a, b)


class _Directory:
    """Serves snapshots the test sets: the follower's only input (the DHT path is the integration test's).
    Counts reads, so the test can wait for the follower to have looked again instead of sleeping."""

    def __init__(self, peer_id: str, snapshot: SwarmSnapshot) -> None:
        self.peer_id = peer_id
        self.current = snapshot
        self.reads = 0
        self._read = asyncio.Event()

    async def snapshot(self) -> SwarmSnapshot:
        self.reads += 1
        self._read.set()
        return self.current

    async def read_more(self, count: int) -> None:
        target = self.reads + count
        while self.reads < target:
            self._read.clear()
            await self._read.wait()


def _peer(blocks: BlockRange, peer_id: str, max_layers: int) -> Peer:
    identity = Identity(peer_id, peer_id, (f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",), 1 << 30, max_layers)
    peer = Peer(identity, blocks.spec, Executor())
    peer.serve(blocks)
    return peer


def test_follower_serves_the_hull_until_others_keep_what_it_drops(tiny_source):
    """QmA moves 0:3 -> 2:4 while QmB moves 4:6 -> 0:2: QmA must serve 0:4 until QmB serves 0:2. Its open
    session carries over to the hull (which contains 0:3); when the hull narrows to 2:4, the hull keeps serving
    its sessions (make before break) until they end, without holding up the move."""
    spec = tiny_source.spec
    peer = _peer(tiny_source.load_blocks(0, 3, "cpu", "float32", 256), "QmA", max_layers=4)
    handlers = PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]  # no forwarding in this test
    plan = plan_record(1, {"QmA": R(2, 4), "QmB": R(0, 2), "QmC": R(4, 6)})
    others: list[tuple[str, int, int]] = [("QmB", 4, 6), ("QmC", 4, 6)]
    directory = _Directory("QmA", snapshot(plan, ("QmA", 0, 3), *others))
    announced: list[LayerRange] = []
    announcement = asyncio.Event()

    async def announce() -> None:
        held = peer.held
        assert held is not None
        announced.append(held)
        directory.current = snapshot(plan, ("QmA", held.start, held.end), *others)
        announcement.set()

    follower = PlanFollower(
        peer=peer,
        directory=directory,  # type: ignore[arg-type]
        source=tiny_source,
        announce=announce,
        config=FollowConfig(check_interval_s=0.01, handover_timeout_s=60, session_grace_s=60),
    )
    hidden = torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(1))

    def step(sid: str, position: int, tokens: int, start: int = 0, end: int = 2) -> StepRequest:
        return StepRequest(sid, position, hidden[:tokens], start, end, 32, spec.weights_hash)

    async def body() -> None:
        await handlers.rpc_step(step("s1", 0, 3), "client")  # a session open on the old range
        old = peer.current
        move = asyncio.create_task(follower.check())
        await asyncio.wait_for(announcement.wait(), 30)  # the hull 0:4 comes first: nothing dropped
        assert announced == [R(0, 4)] and peer.held == R(0, 4) and peer.status is Status.MOVING
        # 0:4 contains 0:3: s1 carried over (same key, same cache), the old range is gone at once.
        assert [s.range for s in peer.ranges] == [R(0, 4)] and peer.current is old
        assert old is not None and set(old.sessions) == {"s1@client"}
        await handlers.rpc_step(step("s1", 3, 1), "client")  # s1's steps still name 0:2
        await handlers.rpc_step(step("s2", 0, 3, 0, 4), "client")  # a new session opens on the hull
        await handlers.rpc_close(CloseRequest("s1"), "client")
        await directory.read_more(3)  # the follower looked three times more: 0:2 is nobody else's yet
        assert peer.held == R(0, 4) and not move.done() and peer.ranges[-1].range == R(0, 4)
        others[0] = ("QmB", 0, 2)
        announcement.clear()
        directory.current = snapshot(plan, ("QmA", 0, 4), *others)
        await asyncio.wait_for(announcement.wait(), 30)  # now 2:4 takes new sessions; s2 stays on the hull
        await asyncio.wait_for(move, 30)  # the move is done; the hull retires in the background
        assert announced == [R(0, 4), R(2, 4)] and peer.held == R(2, 4)
        assert [s.range for s in peer.ranges] == [R(0, 4), R(2, 4)]
        assert [(o.start, o.end, o.sessions) for o in peer.record().older_ranges] == [(0, 4, 1)]
        await handlers.rpc_step(step("s2", 3, 1, 0, 4), "client")
        await handlers.rpc_close(CloseRequest("s2"), "client")  # its end lets the hull go
        await asyncio.wait_for(follower.retired(), 30)
        assert [s.range for s in peer.ranges] == [R(2, 4)] and peer.status is Status.SERVING
        assert follower.adopted_epoch == 1 and follower.moves == 1 and peer.record().older_ranges == []
        reply = await handlers.rpc_step(step("s3", 0, 2, 2, 4), "client")
        assert reply.hidden.shape == (2, spec.hidden_size)

    async def main() -> None:
        runner = asyncio.create_task(peer.executor.run())
        try:
            await body()
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner

    asyncio.run(main())
