"""The plan's flows avoid slow links when other links carry the same tokens (graph.max_flow, least delay)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.planner import solve
from swarm.planner.cluster import Cluster, ClusterNode, full_mesh_links
from swarm.planner.graph import link_flow_share, max_flow
from swarm.planner.synthetic import slow_link_layout
from swarm.types import SINK, SOURCE, LayerRange, NodeID
from tests.unit.planner.helpers import random_small_cluster

pytestmark = pytest.mark.timeout(60)

HALVES = {
    "p1": LayerRange(0, 15),
    "p2": LayerRange(0, 15),
    "p3": LayerRange(15, 30),
    "p4": LayerRange(15, 30),
}


def _shuffled(cluster: Cluster, rng: random.Random) -> Cluster:
    nodes, links = list(cluster.nodes), list(cluster.links)
    rng.shuffle(nodes)
    rng.shuffle(links)
    return Cluster(cluster.model, tuple(nodes), tuple(links))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_slow_link_carries_no_flow_when_the_others_can_carry_it(seed: int) -> None:
    cluster, slow = slow_link_layout()
    rng = random.Random(seed)
    cluster = _shuffled(cluster, rng)
    order = list(HALVES)
    rng.shuffle(order)  # in half of the orders preflow-push sends half the flow over the slow link
    placement = {NodeID(n): HALVES[n] for n in order}
    plan = max_flow(cluster, placement)
    fastest = max_flow(cluster, placement, least_delay=False)
    assert plan.max_flow_tokens_s == pytest.approx(fastest.max_flow_tokens_s)
    assert plan.max_flow_tokens_s == pytest.approx(2 * 2000.0 / 15, rel=1e-4)  # two halves, compute-bound
    assert link_flow_share(plan, *slow) == 0.0
    into_second_half = sum(f.tokens_s for f in plan.flows if f.dst in ("p3", "p4") and f.src != SOURCE)
    assert into_second_half == pytest.approx(plan.max_flow_tokens_s)


@pytest.mark.parametrize("seed", range(6))
def test_with_no_slow_link_the_flows_are_preflow_pushs_spread_over_replicas(seed: int) -> None:
    cluster, _ = slow_link_layout()
    uniform = Cluster(cluster.model, cluster.nodes, full_mesh_links(cluster.nodes, 125e6, 0.005))
    order = list(HALVES)
    random.Random(seed).shuffle(order)
    placement = {NodeID(n): HALVES[n] for n in order}
    plan = max_flow(uniform, placement)
    assert plan.flows == max_flow(uniform, placement, least_delay=False).flows


def test_a_slow_link_the_max_flow_needs_still_carries_its_part() -> None:
    cluster, slow = slow_link_layout()
    # p4 idle: p1's tokens can only go on over the slow link, and the plan must not give them up.
    placement = {NodeID("p1"): HALVES["p1"], NodeID("p2"): HALVES["p2"], NodeID("p3"): LayerRange(15, 30)}
    plan = max_flow(cluster, placement)
    assert plan.max_flow_tokens_s == pytest.approx(2000.0 / 15, rel=1e-4)  # p3 alone holds the second half
    # p2 -> p3 can carry it all, so the slow link still carries nothing; without p2 it must carry everything.
    assert link_flow_share(plan, *slow) == 0.0
    del placement[NodeID("p2")]
    alone = max_flow(cluster, placement)
    assert link_flow_share(alone, *slow) == pytest.approx(1.0)


def test_the_planned_flow_over_a_10x_slower_link_is_at_most_a_tenth() -> None:
    cluster, slow = slow_link_layout()
    plan = solve(cluster, "milp", time_limit_s=5.0)
    assert plan.max_flow_tokens_s == pytest.approx(2 * 2000.0 / 15, rel=1e-3)
    assert link_flow_share(plan, *slow) <= 0.1


@pytest.mark.parametrize("seed", range(8))
def test_least_delay_keeps_the_max_flow_value_and_conserves_flow(seed: int) -> None:
    cluster = random_small_cluster(seed)
    placement = solve(cluster, "greedy").placement
    plan = max_flow(cluster, placement)
    assert plan.max_flow_tokens_s == pytest.approx(
        max_flow(cluster, placement, least_delay=False).max_flow_tokens_s
    )
    for n in placement:
        inflow = sum(f.tokens_s for f in plan.flows if f.dst == n)
        outflow = sum(f.tokens_s for f in plan.flows if f.src == n)
        assert inflow == pytest.approx(outflow, abs=1e-6)
    assert sum(f.tokens_s for f in plan.flows if f.dst == SINK) == pytest.approx(plan.max_flow_tokens_s)


def test_link_flow_share_of_an_empty_plan_is_zero() -> None:
    cluster, slow = slow_link_layout()
    assert link_flow_share(max_flow(cluster, {}), *slow) == 0.0


def test_a_published_plan_gives_a_little_flow_to_keep_a_faster_peers_surplus_off_the_slow_link() -> None:
    # p1 and p3, the slow link's ends, compute a third faster than p2 and p4: with the whole max flow kept,
    # what p1 has over p4's share can only reach p3 over the slow link. Giving up a tenth keeps most of it off.
    cluster, slow = slow_link_layout()

    def faster(node: ClusterNode) -> ClusterNode:
        return replace(node, tokens_s_by_layers=tuple(1.35 * t for t in node.tokens_s_by_layers))

    cluster = replace(cluster, nodes=tuple(faster(n) if n.id in slow else n for n in cluster.nodes))
    placement = {
        n.id: LayerRange(0, 15) if n.id in ("p1", "p2") else LayerRange(15, 30) for n in cluster.nodes
    }
    whole = max_flow(cluster, placement)
    giving = max_flow(cluster, placement, give=0.1)
    assert link_flow_share(whole, *slow) > 0.1  # the surplus crosses the slow link
    assert link_flow_share(giving, *slow) <= 0.1 * whole.max_flow_tokens_s / giving.max_flow_tokens_s
    assert giving.max_flow_tokens_s >= 0.9 * whole.max_flow_tokens_s - 0.01  # milli-token rounding
    for n in placement:  # still a flow: conserved at every node
        inflow = sum(f.tokens_s for f in giving.flows if f.dst == n)
        outflow = sum(f.tokens_s for f in giving.flows if f.src == n)
        assert inflow == pytest.approx(outflow, abs=1e-6)
