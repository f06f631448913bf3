"""Prefill and decode as two flows over one placement (swarm.planner.split): hand-computed instances, today's plan
where splitting does not pay, conservation and capacities of both flows, and the plan through PlanRecord."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from swarm.dht.schemas import PlanRecord
from swarm.planner.cluster import Cluster, ClusterNode
from swarm.planner.graph import max_flow, valid_edges
from swarm.planner.solve import solve
from swarm.planner.split import KV_KEY, PREFILL_KEY, SplitConfig, phase_flows, split_plan
from swarm.planner.two_class import two_class_cluster
from swarm.types import SOURCE, EdgeFlow, LayerRange, NodeID, Plan
from tests.unit.planner.helpers import mesh_cluster, node, random_small_cluster

MIX = 3.0  # prompt tokens per generated token in the hand-computed instances


def with_prefill(n: ClusterNode, prefill_rate: float, kv: list[int] | None = None) -> ClusterNode:
    """The node with a prefill table prefill_rate / k (and a KV table when given)."""
    extra = {PREFILL_KEY: [prefill_rate / k for k in range(1, n.max_layers + 1)]}
    if kv is not None:
        extra[KV_KEY] = kv
    return replace(n, extra=extra)


def two_node_cluster() -> Cluster:
    """Two layers, each node able to hold both: g prefills 10x faster than it decodes, o as fast as it decodes."""
    g = with_prefill(node("g", 2, 200.0), 2000.0)  # holding both layers: decode 100, prefill 1000 tokens/s
    o = with_prefill(node("o", 2, 200.0), 200.0)  # decode 100, prefill 100
    return mesh_cluster([g, o], 2)


def both_hold_all(cluster: Cluster) -> Plan:
    return max_flow(cluster, {NodeID("g"): LayerRange(0, 2), NodeID("o"): LayerRange(0, 2)})


def on_edge(flows: tuple[EdgeFlow, ...], src: str, dst: str) -> float:
    return sum(f.tokens_s for f in flows if (f.src, f.dst) == (src, dst))


def test_two_classes_prefill_on_the_fast_node_decode_on_the_other() -> None:
    # Single routes: a request's m prompt tokens and 1 decode token on one node, z (m / p + 1 / d) <= 1:
    # g: z <= 1 / (3 / 1000 + 1 / 100) = 76.92, o: z <= 1 / (3 / 100 + 1 / 100) = 25, so 101.92 decode tokens/s.
    # Split: o decodes only (100), g prefills everything, 3 (D_g + 100) / 1000 + D_g / 100 <= 1: D_g = 53.85.
    cluster = two_node_cluster()
    config = SplitConfig(prompt_tokens_per_output=MIX, mean_output_tokens=1.0)
    single = phase_flows(cluster, both_hold_all(cluster).placement, config, split=False)
    assert single.decode_tokens_s == pytest.approx(1 / 0.013 + 25.0, rel=1e-6)
    plan = split_plan(cluster, both_hold_all(cluster), config)
    assert plan.decode_flows, "splitting pays here: the plan must carry two flows"
    decode = plan.extra["split_decode_tokens_s"]
    assert decode == pytest.approx(100.0 + 0.7 / 0.013, rel=1e-6)
    assert on_edge(plan.flows, SOURCE, "o") == pytest.approx(0.0, abs=1e-6)  # no prompt on the slow prefiller
    assert on_edge(plan.flows, SOURCE, "g") == pytest.approx(MIX * decode, rel=1e-6)
    assert on_edge(plan.decode_flows, SOURCE, "o") == pytest.approx(100.0, rel=1e-6)
    assert plan.extra["split_gain"] == pytest.approx(decode / single.decode_tokens_s - 1)
    assert (
        plan.max_flow_tokens_s == both_hold_all(cluster).max_flow_tokens_s
    )  # the one-kind figure, as before


def test_kv_memory_caps_the_decode_flow_through_a_node() -> None:
    # o's KV holds 10 sessions of 100 tokens, each decoding 2 tokens/s: at most 20 decode tokens/s through it.
    g = with_prefill(node("g", 2, 200.0), 2000.0)
    o = with_prefill(node("o", 2, 200.0), 200.0, kv=[500, 1000])
    cluster = mesh_cluster([g, o], 2)
    config = SplitConfig(
        prompt_tokens_per_output=MIX, mean_output_tokens=1.0, session_tokens=100.0, session_tokens_s=2.0
    )
    flows = phase_flows(cluster, both_hold_all(cluster).placement, config, split=True)
    assert on_edge(flows.decode, SOURCE, "o") == pytest.approx(20.0, rel=1e-6)


def test_homogeneous_nodes_keep_todays_plan() -> None:
    # Every node has the same prefill-to-decode ratio: nothing to gain by splitting, the plan stays today's.
    nodes = [with_prefill(node(f"n{i}", 4, 400.0), 4000.0) for i in range(4)]
    cluster = mesh_cluster(nodes, 8)
    today = solve(cluster, "milp", time_limit_s=2.0)
    planned = split_plan(cluster, today, SplitConfig(min_gain=0.0))
    assert planned == today
    assert planned.decode_flows == ()
    single = phase_flows(cluster, today.placement, SplitConfig(), split=False)
    split = phase_flows(cluster, today.placement, SplitConfig(), split=True)
    assert split.decode_tokens_s == pytest.approx(single.decode_tokens_s, rel=1e-6)


def test_nodes_without_prefill_speeds_keep_todays_plan() -> None:
    cluster = mesh_cluster([node("a", 2, 100.0), node("b", 2, 300.0)], 2)
    today = max_flow(cluster, {NodeID("a"): LayerRange(0, 2)})
    assert split_plan(cluster, today) is today


def test_a_small_gain_keeps_todays_plan() -> None:
    cluster = two_node_cluster()
    today = both_hold_all(cluster)
    config = SplitConfig(prompt_tokens_per_output=MIX, mean_output_tokens=1.0, min_gain=0.6)  # gain is 0.51
    assert split_plan(cluster, today, config) is today


def test_split_serves_at_least_what_single_routes_do() -> None:
    checked = 0
    for seed in range(40):
        rng = random.Random(seed)
        cluster = random_small_cluster(seed)
        if sum(cluster.layer_cap(n) for n in cluster.nodes) < cluster.model.num_layers:
            continue  # no valid placement
        nodes = tuple(
            with_prefill(n, rng.uniform(1.0, 10.0) * n.tokens_s_by_layers[0]) for n in cluster.nodes
        )
        cluster = Cluster(cluster.model, nodes, cluster.links)
        placement = solve(cluster, "greedy").placement
        config = SplitConfig(prompt_tokens_per_output=rng.uniform(0.5, 5.0))
        single = phase_flows(cluster, placement, config, split=False)
        split = phase_flows(cluster, placement, config, split=True)
        assert split.decode_tokens_s >= single.decode_tokens_s * (1 - 1e-6) - 1e-6, seed
        check_flows(cluster, placement, split.prefill, split.decode, config)
        checked += 1
    assert checked >= 10


def check_flows(
    cluster: Cluster,
    placement: dict[NodeID, LayerRange],
    prefill: tuple[EdgeFlow, ...],
    decode: tuple[EdgeFlow, ...],
    config: SplitConfig,
) -> None:
    """Both flows on valid edges, conserved at every node, within link capacity and the nodes' time."""
    caps = {(u, v): c for u, v, c in valid_edges(cluster, placement)}
    for f in prefill + decode:
        assert (f.src, f.dst) in caps, f"flow on an edge the placement does not make valid: {f}"
    for (u, v), cap in caps.items():
        assert on_edge(prefill, u, v) + on_edge(decode, u, v) <= cap * (1 + 1e-6) + 1e-6
    for node_id, layers in placement.items():
        n, k = cluster.node_by_id[node_id], len(layers)
        busy = 0.0
        for flows, speed in ((prefill, n.extra[PREFILL_KEY][k - 1]), (decode, n.tokens_s(k))):
            inflow = sum(f.tokens_s for f in flows if f.dst == node_id)
            outflow = sum(f.tokens_s for f in flows if f.src == node_id)
            assert inflow == pytest.approx(outflow, rel=1e-6, abs=1e-6)
            busy += inflow / speed if speed > 0 else 0.0
        assert busy <= 1 + 1e-6
    source_p = sum(f.tokens_s for f in prefill if f.src == SOURCE)
    source_d = sum(f.tokens_s for f in decode if f.src == SOURCE)
    assert source_p == pytest.approx(config.prompt_tokens_per_output * source_d, rel=1e-6, abs=1e-6)


def test_two_class_cluster_prefills_on_gaming_cards_and_decodes_on_big_memory_cards() -> None:
    cluster = two_class_cluster(8, 8)
    today = solve(cluster, "milp", time_limit_s=2.0)
    config = SplitConfig(session_tokens_s=3.0)
    plan = split_plan(cluster, today, config)
    assert plan.decode_flows and plan.extra["split_gain"] >= config.min_gain
    check_flows(cluster, plan.placement, plan.flows, plan.decode_flows, config)
    prefill_on = {f.dst for f in plan.flows if f.dst in plan.placement}
    decode_on = {f.dst for f in plan.decode_flows if f.dst in plan.placement}
    assert prefill_on and all(n.startswith("rtx4090") for n in prefill_on)
    assert {n for n in plan.placement if n.startswith("mi50")} <= decode_on


def test_split_plan_round_trips_through_plan_record() -> None:
    cluster = two_node_cluster()
    plan = split_plan(
        cluster, both_hold_all(cluster), SplitConfig(prompt_tokens_per_output=MIX, mean_output_tokens=1.0)
    )
    plan = replace(plan, epoch=4)
    assert plan.decode_flows
    record = PlanRecord(epoch=4, planner_peer_id="QmA", plan=plan.to_json(), created_at=0.0)
    back = PlanRecord.model_validate(record.to_dht(), strict=True).to_plan()
    assert back.placement == plan.placement
    assert back.flows == plan.flows
    assert back.decode_flows == plan.decode_flows
    assert back.max_flow_tokens_s == plan.max_flow_tokens_s
    # A plan of one flow keeps its old bytes: no decode_flows key at all.
    assert "decode_flows" not in both_hold_all(cluster).to_json()
