"""Planner election on a real DHT: three candidate processes, one planner, a successor after a SIGKILL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from swarm.dht import Directory, SwarmSnapshot
from tests.integration.test_dht import TTL_S, children, observer, wait_for

LEASE_S = TTL_S  # the children run ElectionConfig(lease_s=TTL_S)


def claims(snapshot: SwarmSnapshot) -> list[str]:
    """Live lease records that claim the lease (should settle to exactly one)."""
    return [pid for pid, r in snapshot.leases.items() if r.held_since is not None and not r.leaving]


def single_planner(alive: set[str]) -> Callable[[SwarmSnapshot], bool]:
    def ok(snapshot: SwarmSnapshot) -> bool:
        return snapshot.planner_peer_id in alive and claims(snapshot) == [snapshot.planner_peer_id]

    return ok


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_one_planner_and_takeover_after_kill() -> None:
    asyncio.run(_test_one_planner_and_takeover_after_kill())


async def _test_one_planner_and_takeover_after_kill() -> None:
    async with observer() as boot:
        peers = boot.visible_maddrs()
        with children((peers, "0:4", True), (peers, "4:8", True), (peers, "0:8", True)) as kids:
            directory = Directory(boot)
            alive = {k.peer_id for k in kids}
            first, took_s = await wait_for(directory.snapshot, single_planner(alive), 20.0)
            print(f"planner {first.planner_peer_id} elected after {took_s:.2f} s")
            # It stays the planner: renewals keep the lease with the same holder.
            await asyncio.sleep(LEASE_S)
            again = await directory.snapshot()
            assert again.planner_peer_id == first.planner_peer_id

            leader = next(k for k in kids if k.peer_id == first.planner_peer_id)
            leader.kill()
            killed_at = time.monotonic()
            alive.discard(leader.peer_id)
            second, _ = await wait_for(directory.snapshot, single_planner(alive), 2 * LEASE_S + 2.0)
            takeover_s = time.monotonic() - killed_at
            print(
                f"planner {second.planner_peer_id} took over {takeover_s:.2f} s after SIGKILL (lease {LEASE_S} s)"
            )
            assert takeover_s <= 2 * LEASE_S
