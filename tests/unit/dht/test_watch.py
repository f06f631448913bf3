"""SwarmWatch: a full read only when the planner's summary tells of something the last read did not show."""

from __future__ import annotations

import asyncio

import pytest

from swarm.dht.directory import SwarmSnapshot, membership_digest
from swarm.dht.schemas import PeerRecord, PlanRecord, SummaryRecord
from swarm.dht.watch import SwarmWatch, WatchConfig
from swarm.types import LayerRange, NodeID, Plan
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(10)

PLANNER = "QmPlanner"


def plan_record(epoch: int) -> PlanRecord:
    plan = Plan("greedy", {NodeID("QmA"): LayerRange(0, 8)}, 10.0, epoch=epoch)
    return PlanRecord(epoch=epoch, planner_peer_id=PLANNER, plan=plan.to_json(), created_at=0.0)


class Board:
    """The directory as the watch sees it: a snapshot of `peers` and `epoch`, and summaries by writer."""

    def __init__(self) -> None:
        self.peers: dict[str, PeerRecord] = {"QmA": peer_record("QmA", 0, 8)}
        self.epoch = 1
        self.summaries: dict[str, SummaryRecord] = {}
        self.full_reads = 0
        self.thorough_reads = 0
        self.missed: set[str] = set()  # peers a plain read misses (the node asked lacks their records)
        self.peer_id = "QmReader"

    def summarize(self, writer: str = PLANNER, created_at: float = 1.0) -> None:
        self.summaries[writer] = SummaryRecord(
            planner_peer_id=writer,
            plan_epoch=self.epoch,
            peers_digest=membership_digest(self.peers),
            peer_count=len(self.peers),
            created_at=created_at,
        )

    async def snapshot(self, plans: bool = True, thorough: bool = False) -> SwarmSnapshot:
        self.full_reads += 1
        self.thorough_reads += thorough
        peers = {p: r for p, r in self.peers.items() if thorough or p not in self.missed}
        return SwarmSnapshot(
            peers=peers, plan=plan_record(self.epoch), planner_peer_id=PLANNER, fetched_at=0.0
        )

    async def read_summaries(self, copy: int = 0) -> dict[str, SummaryRecord]:
        return dict(self.summaries)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch_of(board: Board, clock: Clock) -> SwarmWatch:
    return SwarmWatch(board, WatchConfig(poll_s=1.0, fallback_s=5.0), clock=clock)  # type: ignore[arg-type]


def test_an_unchanged_summary_costs_no_full_read() -> None:
    async def body() -> None:
        board, clock = Board(), Clock()
        board.summarize()
        watch = watch_of(board, clock)
        await watch.tick()  # the first look reads everything
        for _ in range(20):
            clock.now += 1.0
            await watch.tick()
        assert board.full_reads == 1 and watch.summary_reads == 20

    asyncio.run(body())


def test_a_join_or_a_new_plan_in_the_summary_makes_one_full_read() -> None:
    async def body() -> None:
        board, clock = Board(), Clock()
        board.summarize()
        watch = watch_of(board, clock)
        await watch.tick()
        version = watch.version
        board.peers["QmB"] = peer_record("QmB", 0, 8)  # a join, then the planner's summary of it
        board.summarize(created_at=2.0)
        woken = asyncio.ensure_future(watch.wait_newer(version, timeout_s=5.0))
        await watch.tick()
        await woken
        assert board.full_reads == 2 and set(watch.snapshot.peers) == {"QmA", "QmB"}  # type: ignore[union-attr]
        await watch.tick()
        assert board.full_reads == 2  # the same summary again: nothing new
        board.epoch = 2
        board.summarize(created_at=3.0)
        await watch.tick()
        assert board.full_reads == 3 and watch.snapshot.plan.epoch == 2  # type: ignore[union-attr]

    asyncio.run(body())


def test_without_a_trusted_summary_it_reads_everything_at_the_fallback_pace() -> None:
    async def body() -> None:
        board, clock = Board(), Clock()
        watch = watch_of(board, clock)
        await watch.tick()
        for _ in range(10):  # 10 s with no summary: one more read every fallback_s (5 s)
            clock.now += 1.0
            await watch.tick()
        assert board.full_reads == 3

    asyncio.run(body())


def test_a_newer_summary_from_another_writer_is_not_relied_on() -> None:
    async def body() -> None:
        board, clock = Board(), Clock()
        board.summarize()
        watch = watch_of(board, clock)
        await watch.tick()
        # Someone else claims a newer summary that says nothing changed: the holder's alone no longer
        # decides, so the watch reads at the fallback pace (and no faster) until that clears up.
        board.summaries["QmOther"] = board.summaries[PLANNER].model_copy(
            update={"planner_peer_id": "QmOther", "created_at": 9.0}
        )
        for _ in range(10):
            clock.now += 1.0
            await watch.tick()
        assert board.full_reads == 3

    asyncio.run(body())


def test_a_read_that_missed_the_summarys_plan_is_made_again() -> None:
    """The summary tells of plan 2, but the full read it caused still found plan 1 (the plan's store reached
    only some of its nodes): the next poll reads again, until the plan is there."""

    async def body() -> None:
        board, clock = Board(), Clock()
        board.summarize()
        watch = watch_of(board, clock)
        await watch.tick()
        board.epoch = 2
        board.summarize(created_at=2.0)
        board.epoch = 1  # the plan record itself is not readable yet
        clock.now += 1.0
        await watch.tick()
        assert board.full_reads == 2 and watch.snapshot.plan.epoch == 1  # type: ignore[union-attr]
        board.epoch = 2
        clock.now += 1.0
        await watch.tick()
        assert board.full_reads == 3 and watch.snapshot.plan.epoch == 2  # type: ignore[union-attr]
        clock.now += 1.0
        await watch.tick()
        assert board.full_reads == 3

    asyncio.run(body())


def test_a_read_that_misses_a_member_the_summary_saw_asks_more_nodes() -> None:
    async def body() -> None:
        board, clock = Board(), Clock()
        board.summarize()
        watch = watch_of(board, clock)
        await watch.tick()
        board.peers["QmB"] = peer_record("QmB", 0, 8)
        board.missed = {"QmB"}
        board.summarize(created_at=2.0)
        clock.now += 1.0
        await watch.tick()
        assert watch.snapshot is not None and "QmB" in watch.snapshot.peers
        assert board.thorough_reads == 1 and board.full_reads == 3

    asyncio.run(body())
