"""Small hand-made clusters shared by the planner tests."""

from __future__ import annotations

import random

from swarm.planner.cluster import Cluster, ClusterLink, ClusterNode, ModelInfo, full_mesh_links
from swarm.types import SINK, SOURCE, LayerRange, NodeID


def node(node_id: str, cap: int, rate: float, region: str = "A") -> ClusterNode:
    """A node whose throughput holding k layers is rate / k (k = 1..cap)."""
    return ClusterNode(NodeID(node_id), region, cap, tuple(rate / k for k in range(1, cap + 1)))


def mesh_cluster(nodes: list[ClusterNode], num_layers: int, activation_bytes: int = 1000) -> Cluster:
    """One fast region: links never bind."""
    return Cluster(
        ModelInfo("toy", num_layers, activation_bytes, 4), tuple(nodes), full_mesh_links(nodes, 1e12)
    )


def helix_example(slow_bytes_s: float) -> Cluster:
    """The Helix paper's motivating shape: an A100 alone in region A (with the client), an L4 and three T4s
    in region B; fast links inside a region, `slow_bytes_s` between (1000-byte activations)."""
    model = ModelInfo("toy", 12, 1000, 4)
    nodes = (
        node("a100", 12, 1200.0, "A"),
        node("l4", 6, 480.0, "B"),
        node("t4-0", 4, 240.0, "B"),
        node("t4-1", 4, 240.0, "B"),
        node("t4-2", 4, 240.0, "B"),
    )
    links: list[ClusterLink] = []
    for a in nodes:
        for b in nodes:
            if a.id != b.id:
                links.append(ClusterLink(a.id, b.id, 1e9 if a.region == b.region else slow_bytes_s))
        links.append(ClusterLink(SOURCE, a.id, 1e9 if a.region == "A" else slow_bytes_s))
        links.append(ClusterLink(a.id, SINK, 1e9 if a.region == "A" else slow_bytes_s))
    return Cluster(model, nodes, tuple(links))


def random_small_cluster(seed: int) -> Cluster:
    """2-6 nodes, 3-12 layers, random caps and decreasing throughput tables, two regions half the time."""
    rng = random.Random(seed)
    num_layers = rng.randint(3, 12)
    nodes = []
    for i in range(rng.randint(2, 6)):
        cap = rng.randint(1, num_layers)
        rate = rng.uniform(50.0, 500.0)
        table = tuple(round(rate / (k + rng.uniform(0.0, 1.0)), 3) for k in range(1, cap + 1))
        nodes.append(ClusterNode(NodeID(f"n{i}"), rng.choice(["A", "B"]) if seed % 2 else "A", cap, table))
    links: list[ClusterLink] = []
    for a in nodes:
        links.append(ClusterLink(SOURCE, a.id, 1e9))
        links.append(ClusterLink(a.id, SINK, 1e9 if a.region == "A" else 5e4))
        for b in nodes:
            if a.id != b.id:
                links.append(ClusterLink(a.id, b.id, 1e9 if a.region == b.region else 5e4))
    return Cluster(ModelInfo("toy", num_layers, 1000, 4), tuple(nodes), tuple(links))


def ranges(**by_node: tuple[int, int]) -> dict[NodeID, LayerRange]:
    return {NodeID(n.replace("_", "-")): LayerRange(a, b) for n, (a, b) in by_node.items()}
