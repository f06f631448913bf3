"""The live planner's decisions, as pure functions of a snapshot (no network)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from swarm.dht import DirectoryConfig, LinkMeasure, PlanRecord, SwarmSnapshot
from swarm.dht.directory import membership_digest
from swarm.dht.schemas import SummaryRecord
from swarm.peer.planner_service import (
    PlannerConfig,
    PlannerService,
    cluster_from_snapshot,
    current_plan_problem,
    links_changed,
    measurements_changed,
    planned_peers,
    reflow,
    should_publish,
    split_config,
)
from swarm.peer.solver_process import InThread
from swarm.planner import ModelInfo, link_flow_share, max_flow, solve
from swarm.types import SINK, SOURCE, EdgeFlow, LayerRange, NodeID, Plan
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(30)

CONFIG = PlannerConfig(client_bandwidth_bytes_s=1e9, unmeasured_bandwidth_bytes_s=5e8)


def snapshot(*records) -> SwarmSnapshot:  # type: ignore[no-untyped-def]
    return SwarmSnapshot(
        peers={r.peer_id: r for r in records}, plan=None, planner_peer_id=None, fetched_at=0.0
    )


def test_cluster_from_snapshot_nodes_and_links():
    a = peer_record("QmA", 0, 4, max_layers=4, links={"QmB": LinkMeasure(rtt_s=0.01, bandwidth_bytes_s=2e8)})
    b = peer_record("QmB", 4, 8, max_layers=8, links={})
    c = peer_record("QmC", 0, 8, max_layers=8, links={})
    gone = peer_record("QmD", 0, 8, state="leaving")
    unmeasured = peer_record("QmE", 0, 8, decode_layer_tokens_s_b8=0.0)
    cluster = cluster_from_snapshot(snapshot(a, b, c, gone, unmeasured), CONFIG)
    assert cluster is not None
    assert [n.id for n in cluster.nodes] == ["QmA", "QmB", "QmC"]
    node_a, node_b = cluster.node_by_id[NodeID("QmA")], cluster.node_by_id[NodeID("QmB")]
    assert node_a.tokens_s_by_layers == (2000.0, 1000.0, 2000.0 / 3, 500.0)  # b8 / k
    assert node_b.max_layers == 8
    assert cluster.model.num_layers == 8 and cluster.model.activation_bytes_per_token == 64 * 4
    # Measured one way, assumed symmetric; unmeasured pairs get the configured default.
    assert cluster.bandwidth_bytes_s(NodeID("QmA"), NodeID("QmB")) == 2e8
    assert cluster.bandwidth_bytes_s(NodeID("QmB"), NodeID("QmA")) == 2e8
    assert cluster.bandwidth_bytes_s(NodeID("QmB"), NodeID("QmC")) == 5e8
    assert cluster.bandwidth_bytes_s(SOURCE, NodeID("QmC")) == 1e9
    assert cluster.bandwidth_bytes_s(NodeID("QmC"), SINK) == 1e9


def test_each_direction_of_a_link_comes_from_either_end():
    # A measured both ways: A -> B from A's upload, B -> A from A's download; B -> C only from C's record
    # (its download from B); C -> B from C's upload. No link is assumed symmetric where a direction is known.
    a = peer_record(
        "QmA",
        links={"QmB": LinkMeasure(rtt_s=0.1, bandwidth_bytes_s=2.5e6, reverse_bandwidth_bytes_s=1.25e7)},
    )
    b = peer_record("QmB", links={})
    c = peer_record(
        "QmC", links={"QmB": LinkMeasure(rtt_s=0.02, bandwidth_bytes_s=3e7, reverse_bandwidth_bytes_s=4e7)}
    )
    cluster = cluster_from_snapshot(snapshot(a, b, c), CONFIG)
    assert cluster is not None
    pairs = cluster.link_by_pair
    assert pairs[(NodeID("QmA"), NodeID("QmB"))].bandwidth_bytes_s == 2.5e6
    assert pairs[(NodeID("QmB"), NodeID("QmA"))].bandwidth_bytes_s == 1.25e7
    assert pairs[(NodeID("QmB"), NodeID("QmC"))].bandwidth_bytes_s == 4e7
    assert pairs[(NodeID("QmC"), NodeID("QmB"))].bandwidth_bytes_s == 3e7
    assert pairs[(NodeID("QmA"), NodeID("QmB"))].latency_s == pytest.approx(0.05)  # half the RTT
    assert pairs[(NodeID("QmB"), NodeID("QmC"))].latency_s == pytest.approx(0.01)
    assert pairs[(NodeID("QmA"), NodeID("QmC"))].bandwidth_bytes_s == 5e8  # unmeasured: the default
    # and the latency routes assume, never 0: the slow-link rule would read 0 as the fastest link of all
    assert pairs[(NodeID("QmA"), NodeID("QmC"))].latency_s == CONFIG.unmeasured_latency_s > 0


def test_no_plannable_peers_gives_no_cluster():
    assert cluster_from_snapshot(snapshot(peer_record("QmA", state="leaving")), CONFIG) is None


def test_replan_triggers():
    base = cluster_from_snapshot(snapshot(peer_record("QmA"), peer_record("QmB")), CONFIG)
    assert base is not None
    assert measurements_changed(None, base, 0.2) == "first solve"
    same = cluster_from_snapshot(
        snapshot(peer_record("QmA", decode_layer_tokens_s_b8=2100.0), peer_record("QmB")), CONFIG
    )
    assert same is not None and measurements_changed(base, same, 0.2) is None
    slower = cluster_from_snapshot(
        snapshot(peer_record("QmA", decode_layer_tokens_s_b8=1000.0), peer_record("QmB")), CONFIG
    )
    assert slower is not None and "speed moved" in (measurements_changed(base, slower, 0.2) or "")
    joined = cluster_from_snapshot(
        snapshot(peer_record("QmA"), peer_record("QmB"), peer_record("QmC")), CONFIG
    )
    assert joined is not None and "membership" in (measurements_changed(base, joined, 0.2) or "")


def test_publish_only_when_better_or_broken():
    cluster = cluster_from_snapshot(snapshot(peer_record("QmA"), peer_record("QmB")), CONFIG)
    assert cluster is not None
    best = solve(cluster, method="greedy", time_limit_s=5.0)
    assert should_publish(cluster, None, best, 0.1) == "no plan yet"
    assert should_publish(cluster, best, best, 0.1) is None  # equal: keep, no thrashing
    # b8 = 2000 tokens/s per layer: a 4+4 chain runs 500 tokens/s, one peer holding all 8 only 250.
    chain = max_flow(cluster, {NodeID("QmA"): LayerRange(0, 4), NodeID("QmB"): LayerRange(4, 8)})
    lopsided = max_flow(cluster, {NodeID("QmA"): LayerRange(0, 8), NodeID("QmB"): LayerRange(0, 1)})
    assert chain.max_flow_tokens_s == pytest.approx(500.0)
    assert lopsided.max_flow_tokens_s == pytest.approx(250.0)
    assert "max flow" in (should_publish(cluster, lopsided, chain, 0.1) or "")
    assert should_publish(cluster, chain, lopsided, 0.1) is None
    assert should_publish(cluster, lopsided, chain, 1.5) is None  # better, but not by the margin
    stale = Plan(method="milp", placement={NodeID("QmGone"): LayerRange(0, 8)}, max_flow_tokens_s=1.0)
    assert "gone" in (current_plan_problem(cluster, stale) or "")
    assert "gone" in (should_publish(cluster, stale, best, 0.1) or "")


def test_config_checks():
    with pytest.raises(ValueError):
        PlannerConfig(period_s=0.0)
    with pytest.raises(ValueError):
        PlannerConfig(improve_fraction=-1.0)


# ------------------------------------------------------------------------------------------------ trust


def test_announced_speeds_and_links_are_clamped_to_plausible_caps():
    liar = peer_record(
        "QmA", decode_layer_tokens_s_b8=5e8, links={"QmB": LinkMeasure(rtt_s=0.0, bandwidth_bytes_s=1e12)}
    )
    cluster = cluster_from_snapshot(snapshot(liar, peer_record("QmB")), CONFIG)
    assert cluster is not None
    assert cluster.node_by_id[NodeID("QmA")].tokens_s_by_layers[0] == CONFIG.max_layer_tokens_s
    assert cluster.bandwidth_bytes_s(NodeID("QmA"), NodeID("QmB")) == CONFIG.max_link_bandwidth_bytes_s


def test_the_model_comes_from_the_planners_spec_not_the_smallest_id():
    # "Qm1" sorts first and announces a 4-layer model: it used to decide the swarm's shape.
    odd = peer_record("Qm1", 0, 4, num_layers=4, max_layers=4, hidden_size=32)
    model = ModelInfo(name="tiny-llama", num_layers=8, activation_bytes_per_token=64 * 4)
    cluster = cluster_from_snapshot(snapshot(odd, peer_record("QmA"), peer_record("QmB")), CONFIG, model)
    assert cluster is not None and cluster.model == model
    assert [n.id for n in cluster.nodes] == ["QmA", "QmB"]
    # With no spec at hand (tools), the shape most peers announce wins, whatever the ids.
    guessed = cluster_from_snapshot(snapshot(odd, peer_record("QmA"), peer_record("QmB")), CONFIG)
    assert guessed is not None and guessed.model.num_layers == 8


def test_peers_reported_by_enough_distinct_reporters_are_not_planned():
    peers = {r.peer_id: r for r in (peer_record("QmA"), peer_record("QmB"), peer_record("QmC"))}
    reports = {"QmA": frozenset({"r1", "r2"}), "QmB": frozenset({"r1"})}
    snap = SwarmSnapshot(peers=peers, plan=None, planner_peer_id=None, fetched_at=0.0, reports=reports)
    assert set(planned_peers(snap)) == {"QmB", "QmC"}  # default min_reporters 2
    assert set(planned_peers(snap, min_reporters=1)) == {"QmC"}
    assert set(planned_peers(snap, min_reporters=0)) == {"QmA", "QmB", "QmC"}
    cluster = cluster_from_snapshot(snap, CONFIG)
    assert cluster is not None and NodeID("QmA") not in cluster.node_by_id


class _Dht:
    model_hash = "abc123def456"

    @staticmethod
    def now() -> float:
        return 100.0


class _Directory:
    def __init__(self, snap: SwarmSnapshot, accepted_epoch: int | None) -> None:
        self.snap, self.accepted_epoch, self.peer_id, self.dht = snap, accepted_epoch, "QmMe", _Dht()
        self.config, self.write_timeout_s = DirectoryConfig(), 5.0
        self.published: list[PlanRecord] = []
        self.summaries: list[SummaryRecord] = []
        self.plan_reads: list[bool] = []  # whether each snapshot read the plan key

    def now(self) -> float:
        return self.dht.now()

    async def snapshot(self, plans: bool = True) -> SwarmSnapshot:
        self.plan_reads.append(plans)
        return self.snap if plans else dataclasses.replace(self.snap, plan=None)

    async def publish_plan(self, record: PlanRecord) -> bool:
        self.published.append(record)
        return True

    async def publish_summary(self, record: SummaryRecord) -> bool:
        self.summaries.append(record)
        return True


def test_a_new_planner_publishes_its_own_plan_instead_of_re_signing_a_foreign_one():
    placement = {NodeID("QmA"): LayerRange(0, 4), NodeID("QmB"): LayerRange(4, 8)}
    theirs = Plan("milp", placement, 500.0, epoch=7)
    foreign = PlanRecord(epoch=7, planner_peer_id="QmOld", plan=theirs.to_json(), created_at=0.0)
    peers = {r.peer_id: r for r in (peer_record("QmA", 0, 4), peer_record("QmB", 4, 8))}
    snap = SwarmSnapshot(peers=peers, plan=foreign, planner_peer_id="QmMe", fetched_at=0.0)
    directory = _Directory(snap, accepted_epoch=7)
    service = PlannerService(directory, election=None, config=PlannerConfig(method="greedy"))  # type: ignore[arg-type]
    stored = asyncio.run(service.check())
    assert stored is not None and stored.planner_peer_id == "QmMe" and stored.epoch == 8
    assert [r.planner_peer_id for r in directory.published] == ["QmMe"]
    # Summary readers learn of the new epoch and of the membership the planner saw, once.
    (summary,) = directory.summaries
    assert summary.plan_epoch == 8 and summary.peers_digest == membership_digest(peers)
    asyncio.run(service.check())
    assert len(directory.summaries) == 1  # nothing changed: no second summary within summary_refresh_s
    assert directory.plan_reads == [True, False]  # within its term the planner knows its plan
    assert [r.epoch for r in directory.published] == [8]
    with pytest.raises(ValueError, match="re-sign"):
        asyncio.run(service._refresh(foreign))


def _halves(p1_to_p3: LinkMeasure) -> SwarmSnapshot:
    """p1, p2 hold 0:4 and p3, p4 hold 4:8 (4 layers fit each); links measured both ways, p1 -> p3 as given."""
    fast = LinkMeasure(rtt_s=0.01, bandwidth_bytes_s=1.25e8, reverse_bandwidth_bytes_s=1.25e8)
    records = [
        peer_record("p1", 0, 4, max_layers=4, links={"p2": fast, "p3": p1_to_p3, "p4": fast}),
        peer_record("p2", 0, 4, max_layers=4, links={"p1": fast, "p3": fast, "p4": fast}),
        peer_record("p3", 4, 8, max_layers=4, links={"p4": fast}),
        peer_record("p4", 4, 8, max_layers=4, links={}),
    ]
    return SwarmSnapshot(
        peers={r.peer_id: r for r in records}, plan=None, planner_peer_id="QmMe", fetched_at=0.0
    )


def test_a_link_that_became_slow_is_re_flowed_without_moving_anyone():
    fast = LinkMeasure(rtt_s=0.01, bandwidth_bytes_s=1.25e8, reverse_bandwidth_bytes_s=1.25e8)
    slow = LinkMeasure(rtt_s=0.1, bandwidth_bytes_s=1.25e7, reverse_bandwidth_bytes_s=1.25e7)
    before = cluster_from_snapshot(_halves(fast), CONFIG)
    after = cluster_from_snapshot(_halves(slow), CONFIG)
    assert before is not None and after is not None
    assert links_changed(before, before, 0.2) is None
    assert "p1 -> p3" in (links_changed(before, after, 0.2) or "")
    placement = {NodeID(p): LayerRange(0, 4) for p in ("p1", "p2")} | {
        NodeID(p): LayerRange(4, 8) for p in ("p3", "p4")
    }
    crossing = [EdgeFlow(NodeID(a), NodeID(b), 250.0) for a in ("p1", "p2") for b in ("p3", "p4")]
    ends = [EdgeFlow(SOURCE, NodeID(p), 500.0) for p in ("p1", "p2")]
    ends += [EdgeFlow(NodeID(p), SINK, 500.0) for p in ("p3", "p4")]
    blind = Plan("milp", placement, 1000.0, tuple(ends + crossing), epoch=3)
    assert reflow(before, max_flow(before, placement), 0.2)[0] is None  # the same links: the flows stand
    fresh, why = reflow(after, blind, 0.2)
    assert fresh is not None and fresh.placement == placement and "moved" in why
    assert link_flow_share(fresh, NodeID("p1"), NodeID("p3")) == 0.0
    assert fresh.max_flow_tokens_s == pytest.approx(1000.0)


def test_the_live_planner_publishes_the_re_flowed_plan():
    placement = {NodeID(p): LayerRange(0, 4) for p in ("p1", "p2")} | {
        NodeID(p): LayerRange(4, 8) for p in ("p3", "p4")
    }
    ends = [EdgeFlow(SOURCE, NodeID(p), 500.0) for p in ("p1", "p2")]
    ends += [EdgeFlow(NodeID(p), SINK, 500.0) for p in ("p3", "p4")]
    crossing = [EdgeFlow(NodeID(a), NodeID(b), 250.0) for a in ("p1", "p2") for b in ("p3", "p4")]
    ours = Plan("milp", placement, 1000.0, tuple(ends + crossing), epoch=3)
    record = PlanRecord(epoch=3, planner_peer_id="QmMe", plan=ours.to_json(), created_at=0.0)
    slow = LinkMeasure(rtt_s=0.1, bandwidth_bytes_s=1.25e7, reverse_bandwidth_bytes_s=1.25e7)
    snap = _halves(slow)
    snap = SwarmSnapshot(peers=snap.peers, plan=record, planner_peer_id="QmMe", fetched_at=0.0)
    directory = _Directory(snap, accepted_epoch=3)
    config = PlannerConfig(method="greedy", client_bandwidth_bytes_s=1e9)
    service = PlannerService(directory, election=None, config=config, solver=InThread())  # type: ignore[arg-type]
    stored = asyncio.run(service.check())
    assert stored is not None and stored.epoch == 4
    plan = stored.to_plan()
    assert link_flow_share(plan, NodeID("p1"), NodeID("p3")) <= 0.1


def _two_classes() -> SwarmSnapshot:
    """Two peers that prefill 20x faster than they decode and two that prefill as fast as they decode, each
    holding the whole model, with room for many sessions."""
    roomy = dict(cache_tokens_total=1_000_000, free_cache_tokens=1_000_000)
    fast = [peer_record(f"QmG{i}", 0, 8, prefill_layer_tokens_s=40000.0, **roomy) for i in range(2)]
    slow = [peer_record(f"QmO{i}", 0, 8, prefill_layer_tokens_s=2000.0, **roomy) for i in range(2)]
    return snapshot(*fast, *slow)


@pytest.mark.parametrize("split", [False, True])
def test_the_live_planner_splits_the_phases_only_when_asked(split: bool) -> None:
    directory = _Directory(_two_classes(), accepted_epoch=None)
    config = PlannerConfig(method="greedy", client_bandwidth_bytes_s=1e9, split_phases=split)
    service = PlannerService(directory, election=None, config=config, solver=InThread())  # type: ignore[arg-type]
    stored = asyncio.run(service.check())
    assert stored is not None
    plan = stored.to_plan()
    if not split:
        assert plan.decode_flows == ()
        return
    # Prompts go to the fast prefillers only, shared evenly (they are interchangeable); the slow ones decode,
    # and the plan says so once published.
    assert plan.decode_flows
    prompts = {f.dst: f.tokens_s for f in plan.flows if f.src == SOURCE}
    assert set(prompts) == {"QmG0", "QmG1"} and prompts["QmG0"] == prompts["QmG1"]
    assert {f.dst for f in plan.decode_flows if f.src == SOURCE} >= {"QmO0", "QmO1"}


def test_split_phases_reads_each_peers_prefill_speed_and_kv_room() -> None:
    config = PlannerConfig(client_bandwidth_bytes_s=1e9, split_phases=True)
    cluster = cluster_from_snapshot(snapshot(peer_record("QmA", 0, 4), peer_record("QmB", 0, 0)), config)
    assert cluster is not None
    a, b = cluster.node_by_id[NodeID("QmA")], cluster.node_by_id[NodeID("QmB")]
    assert a.extra["prefill_tokens_s_by_layers"][:4] == [8000.0, 4000.0, 8000.0 / 3, 2000.0]
    assert a.extra["kv_tokens_by_layers"][:4] == [
        16384.0,
        8192.0,
        5461.0,
        4096.0,
    ]  # 4096 tokens a layer for 4
    assert "kv_tokens_by_layers" not in b.extra  # holds nothing yet: no cache figure to go by
    plain = cluster_from_snapshot(snapshot(peer_record("QmA", 0, 4)), CONFIG)
    assert plain is not None and plain.node_by_id[NodeID("QmA")].extra == {}


def test_a_split_plan_is_re_flowed_only_when_its_flows_move() -> None:
    config = PlannerConfig(client_bandwidth_bytes_s=1e9, split_phases=True)
    cluster = cluster_from_snapshot(_two_classes(), config)
    assert cluster is not None
    one_kind = solve(cluster, "greedy")
    split = split_config(config)
    fresh, why = reflow(cluster, one_kind, 0.05, split=split)
    assert fresh is not None and fresh.decode_flows, why  # the split is new: most of the flow moved
    again, why = reflow(cluster, fresh, 0.05, split=split)
    assert again is None and why == "flows unchanged"  # same links, same two flows: no new epoch
