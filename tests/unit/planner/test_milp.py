"""The Helix MILP on tiny instances: it must find the brute-force optimum and a bound no lower than it."""

from __future__ import annotations

import itertools
import random

import pytest

from swarm.planner.cluster import Cluster, ClusterLink, ClusterNode, ModelInfo
from swarm.planner.graph import max_flow
from swarm.planner.milp import MilpConfig, prune_links, solve_milp
from swarm.planner.placement import Placement, check_placement
from swarm.types import SINK, SOURCE, LayerRange, NodeID
from tests.unit.planner.helpers import helix_example, mesh_cluster, node

pytestmark = pytest.mark.timeout(60)


def brute_force_best(cluster: Cluster) -> float:
    def options(n: ClusterNode) -> list[LayerRange | None]:
        L = cluster.model.num_layers
        cap = min(n.max_layers, L)
        return [None] + [LayerRange(s, s + k) for k in range(1, cap + 1) for s in range(0, L - k + 1)]

    best = 0.0
    for combo in itertools.product(*(options(n) for n in cluster.nodes)):
        placement: Placement = {n.id: r for n, r in zip(cluster.nodes, combo, strict=True) if r is not None}
        best = max(best, max_flow(cluster, placement).max_flow_tokens_s)
    return best


def tiny_cluster(seed: int) -> Cluster:
    """3 nodes, 4 layers, random tables; odd seeds put one node behind slow links."""
    rng = random.Random(seed)
    nodes = [
        ClusterNode(
            NodeID(f"n{i}"),
            "B" if seed % 2 and i == 0 else "A",
            cap,
            tuple(round(rng.uniform(50, 300) / k, 2) for k in range(1, cap + 1)),
        )
        for i, cap in enumerate(rng.choice([(2, 2, 3), (4, 1, 2), (3, 3, 1), (2, 3, 4)]))
    ]
    links = []
    for a in nodes:
        links.append(ClusterLink(SOURCE, a.id, 1e9))
        links.append(ClusterLink(a.id, SINK, 1e9 if a.region == "A" else 40_000.0))
        for b in nodes:
            if a.id != b.id:
                links.append(ClusterLink(a.id, b.id, 1e9 if a.region == b.region else 40_000.0))
    return Cluster(ModelInfo("toy", 4, 1000, 4), tuple(nodes), tuple(links))


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_brute_force_on_tiny_clusters(seed: int) -> None:
    cluster = tiny_cluster(seed)
    best = brute_force_best(cluster)
    result = solve_milp(cluster, MilpConfig(time_limit_s=10.0, mip_rel_gap=1e-6, prune_k=0))
    assert result.placement is not None
    assert max_flow(cluster, result.placement).max_flow_tokens_s == pytest.approx(best, rel=1e-4, abs=1e-3)
    assert result.dual_bound_valid
    assert result.dual_bound_tokens_s >= best - 1e-3


def test_milp_proves_the_helix_example_optimum_from_scratch() -> None:
    cluster = helix_example(200_000.0)
    result = solve_milp(cluster, MilpConfig(time_limit_s=10.0, mip_rel_gap=1e-6))
    assert result.placement is not None
    check_placement(cluster, result.placement)
    assert max_flow(cluster, result.placement).max_flow_tokens_s == pytest.approx(200.0, rel=1e-3)


def test_warm_start_is_kept_when_already_optimal() -> None:
    cluster = mesh_cluster([node(f"n{i}", 4, 40.0) for i in range(4)], num_layers=8)
    warm = {n.id: LayerRange(0, 4) if i % 2 == 0 else LayerRange(4, 8) for i, n in enumerate(cluster.nodes)}
    result = solve_milp(cluster, MilpConfig(time_limit_s=2.0), warm_start=warm, target_tokens_s=20.0)
    assert result.placement is not None
    assert max_flow(cluster, result.placement).max_flow_tokens_s == pytest.approx(20.0)


def test_pruning_keeps_client_links_and_the_k_fastest_hops() -> None:
    cluster = helix_example(50_000.0)
    pruned = prune_links(cluster, k=3)
    hops = [lk for lk in pruned.links if lk.src not in (SOURCE,) and lk.dst not in (SINK,)]
    assert len([lk for lk in pruned.links if lk.src == SOURCE]) == 5
    assert len([lk for lk in pruned.links if lk.dst == SINK]) == 5
    # Each region-B node keeps its 3 fast neighbours; the A100 has only slow links, all tied, so keeps all 4.
    assert len(hops) == 4 * 3 + 4
