"""The live planner on a real DHT: the lease holder publishes a plan, re-plans when a peer leaves, and
does not churn while nothing changes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from swarm.dht import (
    Announcer,
    DHTConfig,
    Directory,
    DirectoryConfig,
    Election,
    ElectionConfig,
    PeerRecord,
    PlanRecord,
    SwarmDHT,
    SwarmSnapshot,
)
from swarm.peer.planner_service import PlannerConfig, PlannerService
from swarm.types import Plan
from tests.integration.test_dht import TTL_S, wait_for
from tests.unit.dht.records import MODEL_HASH, peer_record


def constant(record: PeerRecord) -> Callable[[], PeerRecord]:
    return lambda: record


class CountingPlanner(PlannerService):
    """The live planner, counting its completed checks so that a test can wait for them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks = 0
        self._checked = asyncio.Condition()

    async def check(self) -> PlanRecord | None:
        stored = await super().check()
        async with self._checked:
            self.checks += 1
            self._checked.notify_all()
        return stored

    async def wait_for_checks(self, count: int) -> None:
        async with self._checked:
            await self._checked.wait_for(lambda: self.checks >= count)


PLANNER = PlannerConfig(period_s=60.0, check_interval_s=0.5, solve_time_limit_s=1.0, method="milp")
WAIT_S = 60.0  # longest wait for what must happen: a busy machine is slow, not wrong


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_planner_publishes_and_replans_when_a_peer_leaves() -> None:
    asyncio.run(_test_planner_publishes_and_replans_when_a_peer_leaves())


async def _test_planner_publishes_and_replans_when_a_peer_leaves() -> None:
    dhts: list[SwarmDHT] = []
    try:
        dhts.append(await SwarmDHT.create(DHTConfig(), MODEL_HASH))
        for _ in range(2):
            dhts.append(
                await SwarmDHT.create(DHTConfig(initial_peers=tuple(dhts[0].visible_maddrs())), MODEL_HASH)
            )
        directories = [Directory(d, DirectoryConfig(ttl_s=TTL_S)) for d in dhts]
        # Three peers that each fit 6 of the 8 layers, currently holding 0:4, 4:8 and 2:6.
        held = [(0, 4), (4, 8), (2, 6)]
        records = [peer_record(d.peer_id, s, e, max_layers=6) for d, (s, e) in zip(dhts, held, strict=True)]
        election = Election(directories[0], ElectionConfig(lease_s=TTL_S, settle_s=0.0))
        service = CountingPlanner(directories[0], election, PLANNER)
        async with asyncio.TaskGroup() as tasks:
            announcers = [
                tasks.create_task(Announcer(directory, constant(r)).run())
                for directory, r in zip(directories, records, strict=True)
            ]
            background = [tasks.create_task(election.run()), tasks.create_task(service.run()), *announcers]
            try:
                reader = directories[1]
                first, took_s = await wait_for(reader.snapshot, lambda s: s.plan is not None, WAIT_S)
                first_plan = first.plan
                assert first_plan is not None and first_plan.planner_peer_id == dhts[0].peer_id
                plan = Plan.from_json(first_plan.plan)
                print(
                    f"plan epoch {first_plan.epoch} after {took_s:.2f} s: {plan.max_flow_tokens_s:.1f} tokens/s"
                )
                assert set(plan.placement) <= {d.peer_id for d in dhts}
                covered = sorted({layer for r in plan.placement.values() for layer in range(r.start, r.end)})
                assert covered == list(range(8))
                assert all(len(r) <= 6 for r in plan.placement.values())

                # Nothing changes: four more completed checks (each reads the swarm and may re-solve) publish
                # no new epoch. Waiting on the checks themselves, not on a sleep that hopes they happened.
                checked = service.checks
                async with asyncio.timeout(WAIT_S):
                    await service.wait_for_checks(checked + 4)
                assert service.published == 1
                still = (await reader.snapshot()).plan
                assert still is not None and still.epoch == first_plan.epoch

                # A planned peer leaves: the planner must publish a plan without it.
                leaver = next(i for i, d in enumerate(dhts[1:], 1) if d.peer_id in plan.placement)
                announcers[leaver].cancel()
                gone = dhts[leaver].peer_id

                def replanned(s: SwarmSnapshot) -> bool:
                    return (
                        s.plan is not None
                        and s.plan.epoch > first_plan.epoch
                        and gone not in s.plan.plan["placement"]
                    )

                second, took_s = await wait_for(reader.snapshot, replanned, WAIT_S)
                assert second.plan is not None
                print(f"re-planned to epoch {second.plan.epoch} {took_s:.2f} s after {gone[-6:]} left")
                assert service.published == 2
            finally:
                for task in background:
                    task.cancel()
    finally:
        for dht in dhts:
            with contextlib.suppress(Exception):
                await dht.aclose()
