"""The baseline heuristics and the annealer always give valid placements; the synthetic clusters are sane."""

from __future__ import annotations

import pytest

from swarm.errors import PlanningError
from swarm.planner.graph import coverage_score, max_flow
from swarm.planner.heuristics import petals_greedy, separate_pipelines, swarm_stages
from swarm.planner.placement import check_placement, repair
from swarm.planner.search import SearchConfig, anneal
from swarm.planner.synthetic import benchmark_clusters, helix_24, helix_42, random_cluster
from swarm.types import LayerRange, NodeID
from tests.unit.planner.helpers import mesh_cluster, node, random_small_cluster

pytestmark = pytest.mark.timeout(30)

HEURISTICS = (petals_greedy, swarm_stages, separate_pipelines)


@pytest.mark.parametrize("heuristic", HEURISTICS, ids=lambda h: h.__name__)
def test_heuristics_are_valid_on_synthetic_clusters(heuristic) -> None:  # type: ignore[no-untyped-def]
    for cluster in (helix_24(), helix_24(3, "30b"), helix_42(), random_cluster(64, 3, "30b", seed=4)):
        placement = heuristic(cluster)
        check_placement(cluster, placement)
        assert max_flow(cluster, placement).max_flow_tokens_s > 0


@pytest.mark.parametrize("seed", range(10))
def test_heuristics_are_valid_on_random_small_clusters(seed: int) -> None:
    cluster = random_small_cluster(seed)
    for heuristic in HEURISTICS:
        try:
            check_placement(cluster, heuristic(cluster))
        except PlanningError as e:
            assert "no valid placement exists" in str(e)


def test_separate_pipelines_builds_one_pipeline_per_gpu_kind() -> None:
    nodes = [node("a0", 4, 100.0), node("a1", 4, 100.0), node("b0", 2, 30.0), node("b1", 2, 30.0)]
    for n, gpu in zip(nodes, "aabb", strict=True):
        n.extra["gpu"] = gpu
    cluster = mesh_cluster(nodes, num_layers=4)
    placement = separate_pipelines(cluster)
    # The a's each hold the whole model alone; the b's chain into one pipeline.
    assert placement[NodeID("a0")] == LayerRange(0, 4)
    assert placement[NodeID("a1")] == LayerRange(0, 4)
    assert {placement[NodeID("b0")], placement[NodeID("b1")]} == {LayerRange(0, 2), LayerRange(2, 4)}


def test_swarm_stages_balances_equal_stages() -> None:
    cluster = mesh_cluster([node(f"n{i}", 2, 20.0) for i in range(4)], num_layers=4)
    placement = swarm_stages(cluster)
    assert sorted(placement.values()) == [LayerRange(0, 2)] * 2 + [LayerRange(2, 4)] * 2


def test_repair_covers_gaps_and_clips_ranges() -> None:
    cluster = mesh_cluster([node("a", 3, 30.0), node("b", 3, 30.0), node("c", 2, 20.0)], num_layers=6)
    broken = {NodeID("a"): LayerRange(0, 5), NodeID("b"): LayerRange(4, 6)}  # a is over its cap of 3
    check_placement(cluster, repair(cluster, broken))


def test_anneal_is_deterministic_for_a_seed_and_never_worse_than_its_start() -> None:
    cluster = helix_24()
    start = petals_greedy(cluster)
    config = SearchConfig(time_limit_s=30.0, max_iters=3000, seed=7)
    first, second = anneal(cluster, start, config), anneal(cluster, start, config)
    assert first == second
    check_placement(cluster, first)
    assert coverage_score(cluster, first) >= coverage_score(cluster, start)


def test_synthetic_clusters_are_seeded_and_realistic() -> None:
    assert random_cluster(24, 2, seed=3) == random_cluster(24, 2, seed=3)
    cluster = helix_24()
    caps = {n.extra["gpu"]: n.max_layers for n in cluster.nodes}
    assert caps["A100"] > caps["L4"] > caps["T4"] >= 1  # 80 GB > 24 GB > 16 GB
    assert len(helix_42().nodes) == 42 and len({n.extra["gpu"] for n in helix_42().nodes}) == 7
    assert len(helix_24(3).regions) == 3
    names = [name for name, _ in benchmark_clusters([8, 24])]
    assert names == [
        "n8-r1-30b",
        "n8-r1-70b",
        "n8-r3-30b",
        "n8-r3-70b",
        "n24-r1-30b",
        "n24-r1-70b",
        "n24-r3-30b",
        "n24-r3-70b",
    ]
