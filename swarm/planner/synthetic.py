"""Seeded synthetic clusters for tests, the simulator and bench_planner.py.

GPU figures are rough public numbers: memory in GB and a relative "layer-tokens/s" rate (tokens/s one GPU
would push through a single layer of the model at a good batch size; A100 = 1.0). A node holding k layers
runs at rate / (k + 1) tokens/s (the +1 is per-token overhead outside the layers: sampling the batch,
sending activations), times a KV factor that falls as the weights leave less memory for the attention cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from swarm.planner.cluster import Cluster, ClusterLink, ClusterNode, ModelInfo
from swarm.types import SINK, SOURCE, NodeID


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gb: float
    relative_rate: float  # layer-tokens/s relative to an A100


GPUS: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("A100", 80.0, 1.0),
        GpuType("V100", 32.0, 0.38),
        GpuType("L4", 24.0, 0.33),
        GpuType("T4", 16.0, 0.16),
        GpuType("RTX3090", 24.0, 0.42),
        GpuType("RTX4090", 24.0, 0.58),
        GpuType("A10G", 24.0, 0.36),
    )
}


@dataclass(frozen=True)
class SyntheticModel:
    info: ModelInfo
    layer_gb: float  # fp16 weights of one transformer block
    a100_layer_tokens_s: float  # layer-tokens/s of one A100 on this model


MODELS: dict[str, SyntheticModel] = {
    # LLaMA-30B-like: 60 blocks, hidden 6656 (fp16 activations), ~0.54 B params per block.
    "30b": SyntheticModel(ModelInfo("llama-30b-class", 60, 6656 * 2, 4), 1.08, 36000.0),
    # LLaMA-2-70B-like: 80 blocks, hidden 8192, ~0.86 B params per block.
    "70b": SyntheticModel(ModelInfo("llama-70b-class", 80, 8192 * 2, 4), 1.72, 24000.0),
}

FAST_LINK_BYTES_S = 1.25e9  # 10 Gb/s inside a region
FAST_LATENCY_S = 0.001
SLOW_LINK_BYTES_S = 12.5e6  # 100 Mb/s between regions
SLOW_LATENCY_S = 0.05


def node_for(
    node_id: str, gpu: GpuType, model: SyntheticModel, region: str, jitter: float = 1.0
) -> ClusterNode:
    """A node with max_layers from memory (10% kept for activations) and its tokens/s table."""
    usable_gb = gpu.memory_gb * 0.9
    max_layers = min(int(usable_gb // model.layer_gb), model.info.num_layers)
    rate = model.a100_layer_tokens_s * gpu.relative_rate * jitter
    table = []
    for k in range(1, max_layers + 1):
        free_fraction = (usable_gb - k * model.layer_gb) / usable_gb
        kv_factor = min(1.0, 0.35 + 2.5 * free_fraction)  # small KV room -> small batches -> lower rate
        table.append(round(rate / (k + 1) * kv_factor, 3))
    return ClusterNode(NodeID(node_id), region, max_layers, tuple(table), {"gpu": gpu.name})


def regional_links(nodes: list[ClusterNode], client_region: str) -> tuple[ClusterLink, ...]:
    """Fast links inside a region, slow ones between regions; the client sits in `client_region`."""

    def bw(a: str, b: str) -> tuple[float, float]:
        return (FAST_LINK_BYTES_S, FAST_LATENCY_S) if a == b else (SLOW_LINK_BYTES_S, SLOW_LATENCY_S)

    links: list[ClusterLink] = []
    for a in nodes:
        links.append(ClusterLink(SOURCE, a.id, *bw(client_region, a.region)))
        links.append(ClusterLink(a.id, SINK, *bw(a.region, client_region)))
        for b in nodes:
            if a.id != b.id:
                links.append(ClusterLink(a.id, b.id, *bw(a.region, b.region)))
    return tuple(links)


def cluster_from_counts(
    counts: dict[str, int], num_regions: int = 1, model: str = "70b", seed: int = 0, jitter: float = 0.0
) -> Cluster:
    """Nodes of the given GPU types, spread round-robin over regions r0..r{n-1}; jitter varies each node's rate."""
    if model not in MODELS:
        raise ValueError(f"unknown synthetic model {model!r}: choose from {sorted(MODELS)}")
    if num_regions < 1:
        raise ValueError("num_regions must be >= 1")
    rng = random.Random(seed)
    spec = MODELS[model]
    nodes: list[ClusterNode] = []
    index = 0
    for gpu_name, count in counts.items():
        if gpu_name not in GPUS:
            raise ValueError(f"unknown GPU type {gpu_name!r}: choose from {sorted(GPUS)}")
        for i in range(count):
            region = f"r{index % num_regions}"
            factor = 1.0 + rng.uniform(-jitter, jitter) if jitter > 0 else 1.0
            nodes.append(node_for(f"{gpu_name.lower()}-{i}", GPUS[gpu_name], spec, region, factor))
            index += 1
    return Cluster(spec.info, tuple(nodes), regional_links(nodes, "r0"))


def random_cluster(num_nodes: int, num_regions: int = 1, model: str = "70b", seed: int = 0) -> Cluster:
    """num_nodes GPUs drawn from all types (seeded), rates jittered by 10%."""
    rng = random.Random(seed)
    names = sorted(GPUS)
    counts: dict[str, int] = {}
    for _ in range(num_nodes):
        name = rng.choice(names)
        counts[name] = counts.get(name, 0) + 1
    return cluster_from_counts(counts, num_regions, model, seed=seed + 1, jitter=0.1)


def helix_24(num_regions: int = 1, model: str = "70b") -> Cluster:
    """The Helix paper's 24-node cluster: 4 A100 + 8 L4 + 12 T4, in one region or spread over three."""
    return cluster_from_counts({"A100": 4, "L4": 8, "T4": 12}, num_regions, model)


def helix_42(num_regions: int = 1, model: str = "70b") -> Cluster:
    """42 nodes of 7 GPU types, 6 of each."""
    return cluster_from_counts({name: 6 for name in GPUS}, num_regions, model)


# The 4-peer layout with one slow link (issue 52's "10x slower link" target), default model on CPU: p1, p2
# can hold layers 0:15 and p3, p4 layers 15:30 (memory caps them at 15 each), so tokens cross from the first
# half to the second over p1 -> p3, p1 -> p4, p2 -> p3 or p2 -> p4. Every link is 1000 Mbit/s at 5 ms one way,
# except p1 -> p3: 100 Mbit/s at 50 ms.
SMOLLM2_135M = ModelInfo("SmolLM2-135M", 30, 576 * 4, 4)  # fp32 activations on CPU
LAYOUT_FAST_BYTES_S = 125e6
LAYOUT_FAST_LATENCY_S = 0.005
LAYOUT_SLOW_BYTES_S = 12.5e6
LAYOUT_SLOW_LATENCY_S = 0.05
LAYOUT_LAYER_TOKENS_S = 2000.0  # decode tokens/s through one layer at batch 8 (order of a CPU core)


def slow_link_layout(
    node_ids: tuple[str, str, str, str] = ("p1", "p2", "p3", "p4"),
) -> tuple[Cluster, tuple[NodeID, NodeID]]:
    """The 4-peer layout above and its slow link (src, dst). `node_ids` names p1..p4 (p1 -> p3 is slow)."""
    nodes = tuple(
        ClusterNode(NodeID(i), "default", 15, tuple(LAYOUT_LAYER_TOKENS_S / k for k in range(1, 16)))
        for i in node_ids
    )
    slow = (NodeID(node_ids[0]), NodeID(node_ids[2]))
    links: list[ClusterLink] = []
    for a in nodes:
        links.append(ClusterLink(SOURCE, a.id, LAYOUT_FAST_BYTES_S, LAYOUT_FAST_LATENCY_S))
        links.append(ClusterLink(a.id, SINK, LAYOUT_FAST_BYTES_S, LAYOUT_FAST_LATENCY_S))
        for b in nodes:
            if a.id != b.id:
                fast = (a.id, b.id) != slow
                bandwidth = LAYOUT_FAST_BYTES_S if fast else LAYOUT_SLOW_BYTES_S
                links.append(
                    ClusterLink(
                        a.id, b.id, bandwidth, LAYOUT_FAST_LATENCY_S if fast else LAYOUT_SLOW_LATENCY_S
                    )
                )
    return Cluster(SMOLLM2_135M, nodes, tuple(links)), slow


def benchmark_clusters(sizes: list[int]) -> list[tuple[str, Cluster]]:
    """(name, cluster) pairs for bench_planner.py: for each size, one region and three, 30B and 70B class."""
    out: list[tuple[str, Cluster]] = []
    for size in sizes:
        for regions in (1, 3):
            for model in ("30b", "70b"):
                if size == 24:
                    cluster = helix_24(regions, model)
                elif size == 42:
                    cluster = helix_42(regions, model)
                else:
                    cluster = random_cluster(size, regions, model, seed=size)
                out.append((f"n{size}-r{regions}-{model}", cluster))
    return out
