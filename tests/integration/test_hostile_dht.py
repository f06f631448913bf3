"""Attacks on the DHT from a fresh key, against 2 real ``swarm-peer join`` processes serving the tiny model.

One swarm serves every test: peer0 holds 0:3 and does not stand for planner, peer1 holds 3:6 and is the
planner (so the lease holder is known). A client-mode observer (the client's own DHT node) reads snapshots
through a Directory that saw the swarm before any attack, and a HostileNode (its own key, no schema checks,
a full DHT node so its copies reach readers even where honest nodes refuse to store them) attacks in turn:

1. a well-formed plan from a non-leader, epoch 10^15, sending every peer to 0:1: nobody moves;
2. malformed plans (placement a list, inf, epoch 2^62, epoch 2^64-1): no peer stops;
3. a lease claimed with held_since=0: the planner keeps the lease;
4. an announcement of 1e12 tokens/s (dropped) and one of 5e8 (clamped): no more flow than the cap.

After each, the client still generates the same greedy ids as before the attacks. Each "nothing happens"
is watched over several follow / lease periods (1 s each here), polling snapshots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from client import SwarmClient
from swarm.dht import Directory, DirectoryConfig, ModelShape, PlanRecord, SwarmSnapshot
from swarm.dht.schemas import lease_key, plan_key, record_key
from swarm.models import resolve_model
from swarm.models.head import SamplingParams
from swarm.peer.planner_service import PlannerConfig, cluster_from_snapshot
from swarm.testing import LocalSwarm
from swarm.testing.hostile import HostileNode, hostile_node
from swarm.types import LayerRange, NodeID, Plan
from tests.unit.dht.records import peer_record

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

FAST = [
    "--max-memory-gb", "0.01",  # 4 tiny layers each: 0:3 + 3:6 is a fine plan, nobody needs to move
    "--record-ttl-s", "15",
    "--planner-lease-s", "3",
    "--planner-check-interval-s", "1",
    "--follow-check-interval-s", "1",
    "--shutdown-grace-s", "2",
]  # fmt: skip
WATCH_S = 5.0  # five follow checks and lease refreshes, and at least one refresh of every peer's record
WAIT_S = 120.0  # longest wait for what must happen: a busy machine is slow, not wrong
CAP_TOKENS_S = 1e6  # PlannerConfig.max_layer_tokens_s's default
PROMPT = [1, 5, 9, 2, 7]
SPEC = resolve_model("tiny").spec


@dataclass
class Harness:
    swarm: LocalSwarm
    client: SwarmClient
    observer: Directory
    attacker: HostileNode
    planner_id: str
    ranges: dict[str, LayerRange]  # what each peer served before the attacks
    baseline: list[int]  # greedy ids before the attacks

    def run(self, coro: Any) -> Any:
        return self.client.run(coro)

    def generate(self) -> list[int]:
        return self.client.generate_ids(PROMPT, 6, SamplingParams())

    def watch(self, check: Callable[[SwarmSnapshot], None], seconds: float = WATCH_S) -> None:
        """Poll snapshots for `seconds`, checking each, and that every peer process still runs; and on until
        every peer refreshed its record since the watch began: its loops ran past the attack, so a watch on a
        busy machine whose peers got no CPU meanwhile does not pass without having seen them act."""

        async def loop() -> None:
            since, clock = self.attacker.now(), asyncio.get_running_loop().time
            deadline, refreshed = clock() + seconds, set[str]()
            async with asyncio.timeout(seconds + WAIT_S):
                while clock() < deadline or refreshed != set(self.ranges):
                    for peer in self.swarm.peers:
                        assert peer.proc.poll() is None, f"{peer.name} exited:\n{peer.log_tail()}"
                    snapshot = await self.observer.snapshot()
                    check(snapshot)
                    refreshed |= {pid for pid in self.ranges if _updated_at(snapshot, pid) > since}
                    await asyncio.sleep(0.5)

        self.run(loop())

    def wait_until(self, condition: Callable[[], Any], timeout_s: float = WAIT_S) -> None:
        self.run(_wait(condition, timeout_s))

    def assert_unmoved(self, snapshot: SwarmSnapshot) -> None:
        """Every peer in place, and the planner still holds the lease with its own plan."""
        for pid, layers in self.ranges.items():
            record = snapshot.peers.get(pid)
            if record is not None:  # one read may miss a record; a move would show on the next
                assert LayerRange(record.range_start, record.range_end) == layers, f"{pid[-6:]} moved"
        assert snapshot.planner_peer_id == self.planner_id
        assert snapshot.plan is None or snapshot.plan.planner_peer_id == self.planner_id


def _serving_the_plan(snapshot: SwarmSnapshot, peer_ids: list[str]) -> bool:
    plan = snapshot.plan.to_plan() if snapshot.plan is not None else None
    if plan is None or set(plan.placement) != set(peer_ids):
        return False
    serving = snapshot.serving()
    return all(
        pid in serving
        and LayerRange(serving[pid].range_start, serving[pid].range_end) == plan.placement[NodeID(pid)]
        for pid in peer_ids
    )


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with LocalSwarm(tmp_path_factory.mktemp("hostile"), model="tiny") as swarm:
        swarm.start_peer("0:3", extra_args=[*FAST, "--no-plan"])
        planner = swarm.start_peer("3:6", extra_args=FAST)
        peer_ids = [p.peer_id for p in swarm.peers]
        with SwarmClient(swarm.initial_peers, model="tiny") as client:
            node = hostile_node(swarm.initial_peers)
            attacker = client.run(node.__aenter__())
            try:
                yield _settle(swarm, client, attacker, planner.peer_id, peer_ids)
            finally:
                client.run(node.__aexit__(None, None, None))


def _settle(
    swarm: LocalSwarm, client: SwarmClient, attacker: HostileNode, planner_id: str, peer_ids: list[str]
) -> Harness:
    """Wait until the planner's plan is published and served, then record the ranges and a baseline answer."""
    shape = ModelShape(SPEC.num_layers, SPEC.hidden_size)
    observer = Directory(client._client.dht, DirectoryConfig(lease_s=3.0), shape=shape)  # the swarm's lease
    box: dict[str, SwarmSnapshot] = {}

    async def settled() -> bool:
        box["s"] = await observer.snapshot()
        return _serving_the_plan(box["s"], peer_ids)

    client.run(_wait(settled, 90))
    ranges = {
        pid: LayerRange(r.range_start, r.range_end) for pid, r in box["s"].peers.items() if pid in peer_ids
    }
    harness = Harness(swarm, client, observer, attacker, planner_id, ranges, [])
    harness.baseline = harness.generate()
    return harness


def _updated_at(snapshot: SwarmSnapshot, peer_id: str) -> float:
    record = snapshot.peers.get(peer_id)
    return record.updated_at if record is not None else 0.0


async def _wait(condition: Callable[[], Any], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.3)


def test_forged_plan_from_a_non_leader_is_ignored(harness: Harness) -> None:
    att = harness.attacker
    forged = Plan("milp", {NodeID(pid): LayerRange(0, 1) for pid in harness.ranges}, 1e3, epoch=10**15)
    record = PlanRecord(
        epoch=10**15, planner_peer_id=att.peer_id, plan=forged.to_json(), created_at=att.now()
    )
    assert harness.run(att.store(plan_key(SPEC.weights_hash), record.to_dht(), att.now() + 120))

    async def visible() -> bool:  # the forgery is in the DHT, valid and signed: only the lease rule stops it
        return att.peer_id in await harness.observer.read_plans()

    harness.wait_until(visible)
    harness.watch(harness.assert_unmoved)
    assert harness.generate() == harness.baseline


def test_malformed_plans_do_not_stop_any_peer(harness: Harness) -> None:
    att = harness.attacker
    good = Plan("milp", {NodeID(pid): r for pid, r in harness.ranges.items()}, 10.0).to_json()
    attacks = [  # (plan body, epoch): each replaces the last under the attacker's subkey, for 2 s
        (good | {"placement": [[pid, 0, 1] for pid in harness.ranges]}, 2**62),
        (good | {"max_flow_tokens_s": float("inf")}, 2**62),
        (good, 2**62),
        (good, 2**64 - 1),
    ]
    expiration = att.now() + 120
    for body, epoch in attacks:
        expiration += 1.0  # a DHT keeps the value with the later expiration
        value = {"epoch": epoch, "planner_peer_id": att.peer_id, "plan": body | {"epoch": epoch}}
        harness.run(att.store(plan_key(SPEC.weights_hash), value | {"created_at": att.now()}, expiration))
        harness.watch(harness.assert_unmoved, seconds=2.0)  # and alive: watch checks every process each poll
    assert harness.generate() == harness.baseline


def test_hijacked_lease_does_not_win_the_election(harness: Harness) -> None:
    att = harness.attacker
    now = att.now()
    lease = {
        "peer_id": att.peer_id,
        "candidate_since": 0.0,
        "held_since": 0.0,
        "updated_at": now,
        "leaving": False,
    }
    assert harness.run(att.store(lease_key(SPEC.weights_hash), lease, now + 120))

    async def visible() -> bool:
        return att.peer_id in await harness.observer.read_leases()

    harness.wait_until(visible)
    harness.watch(harness.assert_unmoved)
    for peer in harness.swarm.peers:
        assert "stepped down as planner" not in peer.log_tail(200_000), peer.name
    assert harness.generate() == harness.baseline


def test_inflated_announcement_gets_no_more_flow_than_the_cap(harness: Harness) -> None:
    att = harness.attacker
    key = record_key(SPEC.weights_hash, att.peer_id)

    def fake(tokens_s: float) -> dict[str, Any]:
        record = peer_record(
            att.peer_id,
            0,
            SPEC.num_layers,
            maddrs=att.visible_maddrs()[:1],
            model_name=SPEC.name,
            model_hash=SPEC.weights_hash,
            num_layers=SPEC.num_layers,
            hidden_size=SPEC.hidden_size,
            max_layers=SPEC.num_layers,
            links={},
            updated_at=att.now(),
        ).to_dht()
        speeds = ("decode_layer_tokens_s_b1", "decode_layer_tokens_s_b8", "prefill_layer_tokens_s")
        return record | dict.fromkeys(speeds, tokens_s)

    harness.run(att.store(key, fake(1e12), att.now() + 120))  # past any hard bound: dropped
    assert harness.run(att.store(key, fake(5e8), att.now() + 120, tag=b"/2"))  # plausible bound, not cap

    async def visible() -> bool:
        return att.peer_id in (await harness.observer.snapshot()).peers

    harness.wait_until(visible)

    def flow_into_fake(snapshot: SwarmSnapshot) -> None:
        fake_speed = (
            snapshot.peers[att.peer_id].decode_layer_tokens_s_b8 if att.peer_id in snapshot.peers else 0
        )
        assert fake_speed <= 5e8  # the 1e12 record never counts
        cluster = cluster_from_snapshot(snapshot, PlannerConfig())
        assert cluster is not None
        node = cluster.node_by_id.get(NodeID(att.peer_id))
        assert node is None or max(node.tokens_s_by_layers) <= CAP_TOKENS_S
        if snapshot.plan is not None:  # the live planner's plans too
            plan = snapshot.plan.to_plan()
            assert sum(f.tokens_s for f in plan.flows if f.dst == att.peer_id) <= CAP_TOKENS_S * (1 + 1e-9)

    harness.watch(flow_into_fake)
