"""The coverage integer program over node kinds: exact on small instances, honest about pooled bounds."""

from __future__ import annotations

import itertools

import pytest

from swarm.planner.coverage_ip import node_kinds, solve_coverage_ip
from swarm.planner.graph import coverage_score
from swarm.planner.heuristics import petals_greedy
from swarm.planner.placement import check_placement
from swarm.planner.synthetic import helix_24, random_cluster
from swarm.types import LayerRange, NodeID
from tests.unit.planner.helpers import mesh_cluster, node, ranges

pytestmark = pytest.mark.timeout(60)


def test_matches_brute_force_coverage() -> None:
    nodes = [node("a", 3, 90.0), node("b", 2, 40.0), node("c", 2, 40.0), node("d", 4, 100.0)]
    cluster = mesh_cluster(nodes, num_layers=5)
    options = [
        [None] + [LayerRange(s, s + k) for k in range(1, n.max_layers + 1) for s in range(0, 6 - k)]
        for n in nodes
    ]
    best = max(
        coverage_score(cluster, {n.id: r for n, r in zip(nodes, combo, strict=True) if r is not None})
        for combo in itertools.product(*options)
    )
    result = solve_coverage_ip(cluster, time_limit_s=10.0)
    assert result.placement is not None
    check_placement(cluster, result.placement)
    assert coverage_score(cluster, result.placement) == pytest.approx(best)
    assert result.bound_valid and result.dual_bound_tokens_s >= best - 1e-6


def test_identical_gpus_form_one_kind_and_jittered_ones_are_pooled_without_a_bound() -> None:
    kinds = node_kinds(helix_24())
    assert sorted(len(members) for _, _, members in kinds) == [4, 8, 12]
    jittered = random_cluster(16, 1, seed=2)
    assert len(node_kinds(jittered)) < 16  # pooled by GPU model
    result = solve_coverage_ip(jittered, time_limit_s=1.0, warm_start=petals_greedy(jittered))
    assert not result.bound_valid  # pooled tables understate nodes, so HiGHS's bound is not a bound
    assert result.placement is not None
    check_placement(jittered, result.placement)


def test_warm_start_is_never_lost_and_current_ranges_stay_put() -> None:
    nodes = [node(f"n{i}", 4, 40.0) for i in range(4)]
    cluster = mesh_cluster(nodes, num_layers=8)
    current = ranges(n0=(4, 8), n1=(0, 4), n2=(4, 8), n3=(0, 4))
    result = solve_coverage_ip(cluster, time_limit_s=2.0, warm_start=current, current=current)
    assert result.placement == current
    assert result.placement[NodeID("n0")] == LayerRange(4, 8)


def test_exact_kinds_give_a_valid_bound_on_jittered_nodes() -> None:
    nodes = [node("a", 3, 90.0), node("b", 3, 88.0), node("c", 2, 40.0)]
    cluster = mesh_cluster(nodes, num_layers=4)
    assert len(node_kinds(cluster, pool=False)) == 3
    result = solve_coverage_ip(cluster, time_limit_s=5.0, pool=False)
    assert result.bound_valid and result.placement is not None
    assert coverage_score(cluster, result.placement) <= result.dual_bound_tokens_s + 1e-6
