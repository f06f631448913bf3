"""solve(): always a valid placement, joint placement beats partition-then-assign, warm start + reload cost."""

from __future__ import annotations

import importlib

import pytest

from swarm.errors import PlanningError
from swarm.planner import solve
from swarm.planner.graph import max_flow
from swarm.planner.heuristics import separate_pipelines, swarm_stages
from swarm.planner.placement import check_placement
from swarm.planner.synthetic import helix_24
from swarm.types import LayerRange, NodeID
from tests.unit.planner.helpers import helix_example, mesh_cluster, node, random_small_cluster, ranges

pytestmark = pytest.mark.timeout(60)
# the module, not the function swarm.planner re-exports under the same name
solve_module = importlib.import_module("swarm.planner.solve")


@pytest.mark.parametrize("seed", range(8))
def test_every_method_returns_a_valid_placement_with_its_flows(seed: int) -> None:
    cluster = random_small_cluster(seed)
    total_cap = sum(min(n.max_layers, cluster.model.num_layers) for n in cluster.nodes)
    for method in ("milp", "search", "greedy", "swarm", "separate"):
        if total_cap < cluster.model.num_layers:
            with pytest.raises(PlanningError, match="no valid placement"):
                solve(cluster, method, time_limit_s=0.3, seed=seed)
            continue
        plan = solve(cluster, method, time_limit_s=0.3, seed=seed)
        check_placement(cluster, plan.placement)
        assert plan.method == method
        assert plan.max_flow_tokens_s == pytest.approx(max_flow(cluster, plan.placement).max_flow_tokens_s)
        assert plan.max_flow_tokens_s <= plan.upper_bound_tokens_s + 1e-6
        assert plan.solve_s > 0


def test_infeasible_cluster_says_why() -> None:
    cluster = mesh_cluster([node("a", 2, 10.0), node("b", 3, 10.0)], num_layers=8)
    with pytest.raises(PlanningError, match="can hold 5 layers in total"):
        solve(cluster, "milp", time_limit_s=0.5)


def test_unknown_method_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown planning method"):
        solve(mesh_cluster([node("a", 2, 10.0)], 2), "magic")


@pytest.mark.parametrize("slow_bytes_s", [100_000.0, 200_000.0])
def test_joint_placement_beats_partition_then_assign(slow_bytes_s: float) -> None:
    cluster = helix_example(slow_bytes_s)
    partitioned = max(
        max_flow(cluster, h(cluster)).max_flow_tokens_s for h in (separate_pipelines, swarm_stages)
    )
    assert partitioned == pytest.approx(160.0)  # A100 alone (100) + three T4s in a pipeline (60)
    plan = solve(cluster, "milp", time_limit_s=3.0, seed=1)
    assert plan.max_flow_tokens_s >= partitioned + 19.0  # 180 and 200 (optimal: equals the bound)
    if slow_bytes_s == 200_000.0:
        assert plan.max_flow_tokens_s == pytest.approx(plan.upper_bound_tokens_s)


def test_reload_cost_keeps_a_good_current_placement() -> None:
    # Two identical pipelines; the current placement is optimal, and so is any relabelling of it.
    nodes = [node(f"n{i}", 4, 40.0) for i in range(4)]
    cluster = mesh_cluster(nodes, num_layers=8)
    current = ranges(n0=(0, 4), n1=(4, 8), n2=(0, 4), n3=(4, 8))
    plan = solve(cluster, "milp", time_limit_s=1.0, current=current, reload_cost=1.0)
    assert plan.placement == current
    assert plan.max_flow_tokens_s == pytest.approx(20.0)


def test_reload_cost_trades_throughput_for_fewer_moves() -> None:
    cluster = mesh_cluster([node("a", 4, 40.0), node("b", 4, 40.0), node("c", 2, 200.0)], num_layers=4)
    current = ranges(a=(0, 4), b=(0, 4))  # 20 tokens/s; c just joined
    cheap = solve(cluster, "search", time_limit_s=0.5, current=current, reload_cost=0.0)
    dear = solve(cluster, "search", time_limit_s=0.5, current=current, reload_cost=1000.0)
    assert cheap.max_flow_tokens_s > 20.0  # moving layers onto c pays off when moves are free
    assert dear.placement == current  # each reloaded layer costs more than the whole swarm's throughput


def test_helix_24_search_is_within_the_bound_and_beats_heuristics() -> None:
    cluster = helix_24()
    plan = solve(cluster, "search", time_limit_s=2.0, seed=0)
    best_heuristic = max(
        solve(cluster, m, time_limit_s=1.0).max_flow_tokens_s for m in ("greedy", "swarm", "separate")
    )
    assert plan.max_flow_tokens_s >= best_heuristic
    assert plan.max_flow_tokens_s <= plan.upper_bound_tokens_s
    assert all(len(r) <= cluster.node_by_id[n].max_layers for n, r in plan.placement.items())


def test_dead_nodes_in_the_current_placement_are_ignored() -> None:
    cluster = mesh_cluster([node("a", 4, 40.0), node("b", 4, 40.0)], num_layers=4)
    current = {NodeID("gone"): LayerRange(0, 4), NodeID("a"): LayerRange(0, 4)}
    plan = solve(cluster, "search", time_limit_s=0.3, current=current, reload_cost=1.0)
    assert NodeID("gone") not in plan.placement
    check_placement(cluster, plan.placement)


def test_stops_once_a_placement_reaches_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # One node that holds the whole model: every heuristic places it, the flow equals the compute bound, so
    # no search or integer program may run (a live planner would otherwise burn its whole time limit).
    ran: list[str] = []
    for phase in ("anneal", "solve_coverage_ip", "solve_milp", "_per_region"):
        monkeypatch.setattr(solve_module, phase, lambda *_a, _phase=phase, **_k: ran.append(_phase))
    cluster = mesh_cluster([node("a", 4, 10.0), node("b", 4, 10.0)], num_layers=4)
    plan = solve(cluster, "milp", time_limit_s=30.0)
    assert plan.max_flow_tokens_s == pytest.approx(plan.upper_bound_tokens_s)
    assert plan.extra == {}  # no phase offered anything: all were skipped
    assert ran == []  # and none was even started
