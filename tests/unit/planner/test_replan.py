"""Re-planning a live swarm: local repair, the capped and priced MILP, matching, spares, the publish rule."""

from __future__ import annotations

import random

import pytest

from swarm.planner.graph import max_flow
from swarm.planner.milp import MilpConfig, solve_milp
from swarm.planner.moves import greedy_moves
from swarm.planner.placement import placement_problems
from swarm.planner.replan import (
    ReplanConfig,
    add_spares,
    local_repair,
    match_ranges,
    moved_nodes,
    publish_reason,
    replan,
)
from swarm.types import LayerRange, NodeID, Plan, coverage
from tests.unit.planner.helpers import mesh_cluster, node

pytestmark = pytest.mark.timeout(60)

R = LayerRange


def ids(placement: dict[str, LayerRange]) -> dict[NodeID, LayerRange]:
    return {NodeID(n): r for n, r in placement.items()}


def test_a_leave_covered_twice_needs_no_move():
    cluster = mesh_cluster([node("b", 3, 300.0), node("c", 3, 300.0), node("d", 3, 300.0)], 6)
    held = ids({"gone": R(0, 3), "b": R(0, 3), "c": R(3, 6), "d": R(3, 6)})
    repaired = local_repair(cluster, held)
    assert repaired == ids({"b": R(0, 3), "c": R(3, 6), "d": R(3, 6)})
    plan, why = replan(cluster, held, ReplanConfig())
    assert plan is not None and plan.placement == repaired and "repaired locally" in why


def test_repair_moves_a_spare_before_any_neighbour():
    # Layers 3:6 are held twice (c, d): either may move to 0:3 without uncovering anything. b could also
    # extend over the gap (it fits all 9 layers), but a spare comes first: b keeps exactly what it holds.
    cluster = mesh_cluster([node("b", 9, 900.0), node("c", 3, 300.0), node("d", 3, 300.0)], 9)
    held = ids({"gone": R(0, 3), "b": R(3, 9), "c": R(3, 6), "d": R(3, 6)})
    repaired = local_repair(cluster, held)
    assert repaired is not None and not placement_problems(cluster, repaired)
    assert repaired[NodeID("b")] == R(3, 9)
    assert len(moved_nodes({n: r for n, r in held.items() if n != "gone"}, repaired)) == 1
    assert {repaired[NodeID("c")], repaired[NodeID("d")]} == {R(0, 3), R(3, 6)}


def test_repair_extends_the_fewest_neighbours_without_a_spare():
    # No spare: a and b each hold layers nobody else holds. a is full (cap 2); b fits 6 and extends alone.
    cluster = mesh_cluster([node("a", 2, 200.0), node("b", 6, 600.0)], 8)
    held = ids({"a": R(0, 2), "gone": R(2, 4), "b": R(4, 8)})
    assert local_repair(cluster, held) == ids({"a": R(0, 2), "b": R(2, 8)})


def test_repair_uses_one_neighbour_from_each_side_when_one_is_not_enough():
    cluster = mesh_cluster([node("a", 4, 400.0), node("b", 5, 500.0)], 8)
    held = ids({"a": R(0, 2), "gone": R(2, 5), "b": R(5, 8)})
    repaired = local_repair(cluster, held)
    assert repaired is not None and not placement_problems(cluster, repaired)
    assert repaired[NodeID("a")].start == 0 and repaired[NodeID("b")].end == 8


def test_repair_gives_up_when_nothing_local_covers_the_gap():
    cluster = mesh_cluster([node("a", 2, 200.0), node("b", 4, 400.0)], 8)
    held = ids({"a": R(0, 2), "gone": R(2, 4), "b": R(4, 8)})
    assert local_repair(cluster, held) is None


def cap_cluster():  # type: ignore[no-untyped-def]
    nodes = [node(x, 4, 400.0) for x in "abcd"] + [node("e", 2, 100.0)]
    current = ids({"a": R(0, 4), "b": R(0, 4), "c": R(0, 4), "d": R(4, 8), "e": R(6, 8)})
    return mesh_cluster(nodes, 8), current


@pytest.mark.parametrize("max_moves", [1, 2])
def test_the_milp_moves_at_most_max_moves_nodes(max_moves):
    cluster, current = cap_cluster()
    # Unconstrained and unpriced, the optimum (200 tokens/s) reshuffles four nodes.
    free = solve_milp(cluster, MilpConfig(time_limit_s=30, node_limit=5000), current=current)
    assert free.placement is not None and len(moved_nodes(current, free.placement)) > max_moves
    config = MilpConfig(time_limit_s=30, node_limit=5000, max_moves=max_moves)
    capped = solve_milp(cluster, config, warm_start=current, current=current)
    assert capped.placement is not None and len(moved_nodes(current, capped.placement)) <= max_moves
    assert max_flow(cluster, capped.placement).max_flow_tokens_s == pytest.approx(200.0)


def test_a_price_per_moved_node_moves_only_what_pays():
    cluster, current = cap_cluster()
    config = MilpConfig(time_limit_s=30, node_limit=5000, move_cost_tokens_s=5.0)
    priced = solve_milp(cluster, config, warm_start=current, current=current)
    assert priced.placement is not None and moved_nodes(current, priced.placement) == [NodeID("c")]


def test_matching_makes_a_permuted_plan_move_nobody():
    nodes = [node(f"n{i}", 4, 400.0) for i in range(6)]
    cluster = mesh_cluster(nodes, 8)
    held = ids({"n0": R(0, 4), "n1": R(0, 4), "n2": R(4, 8), "n3": R(4, 8), "n4": R(2, 6)})
    ranges = list(held.values()) + [None]
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(ranges)
        permuted = {n.id: r for n, r in zip(nodes, ranges, strict=True) if r is not None}
        matched = match_ranges(cluster, held, permuted, loss_fraction=0.0)
        assert moved_nodes(held, matched) == []
        assert matched == held


def test_matching_keeps_ranges_a_node_cannot_fit_where_they_are():
    cluster = mesh_cluster([node("big", 6, 600.0), node("small", 2, 200.0)], 6)
    held = ids({"big": R(0, 2), "small": R(0, 2)})
    new = ids({"big": R(0, 6), "small": R(4, 6)})
    assert match_ranges(cluster, held, new, loss_fraction=0.0) == new  # small cannot take 0:6


def test_spares_grow_toward_the_least_replicated_layers_without_losing_flow():
    nodes = [node("a", 4, 400.0), node("b", 4, 400.0), node("idle", 8, 800.0)]
    cluster = mesh_cluster(nodes, 8)
    placement = ids({"a": R(0, 4), "b": R(4, 8)})
    flow = max_flow(cluster, placement).max_flow_tokens_s
    spared = add_spares(cluster, placement, spare_replicas=1)
    assert min(coverage(spared.values(), 8)) >= 2
    assert max_flow(cluster, spared).max_flow_tokens_s >= flow
    assert spared[NodeID("a")] == R(0, 4) and spared[NodeID("b")] == R(4, 8)


def test_the_publish_rule_refuses_a_small_gain():
    cluster = mesh_cluster([node("a", 4, 400.0), node("b", 4, 400.0)], 4)
    current = ids({"a": R(0, 4), "b": R(0, 4)})
    now = max_flow(cluster, current).max_flow_tokens_s
    small = Plan("replan", dict(current), now * 1.04)
    large = Plan("replan", dict(current), now * 1.06)
    assert publish_reason(cluster, current, small, gain_fraction=0.05) is None
    assert "max flow" in (publish_reason(cluster, current, large, gain_fraction=0.05) or "")
    broken = ids({"a": R(0, 2)})
    assert "restores coverage" in (publish_reason(cluster, broken, small, gain_fraction=0.05) or "")
    assert publish_reason(cluster, None, small, gain_fraction=0.05) == "no plan yet"


def test_replan_keeps_a_working_plan_when_nothing_pays():
    cluster = mesh_cluster([node("a", 4, 400.0), node("b", 4, 400.0)], 4)
    current = ids({"a": R(0, 4), "b": R(0, 4)})
    plan, why = replan(cluster, current, ReplanConfig(time_limit_s=5, node_limit=1000))
    assert plan is None and why == "no clear gain"


def test_greedy_moves_respect_their_count():
    cluster, current = cap_cluster()
    for k in (0, 1, 2):
        assert len(moved_nodes(current, greedy_moves(cluster, current, list(current), k))) <= k


def test_a_joiner_takes_layers_without_moving_anyone():
    cluster = mesh_cluster([node("a", 4, 400.0), node("b", 4, 400.0), node("new", 4, 8.0)], 4)
    current = ids({"a": R(0, 4), "b": R(0, 4)})  # 100 + 100 tokens/s on every layer
    plan, why = replan(cluster, current, ReplanConfig(time_limit_s=5, node_limit=1000))
    assert plan is not None and "take layers" in why
    assert moved_nodes(current, plan.placement) == [] and NodeID("new") in plan.placement
