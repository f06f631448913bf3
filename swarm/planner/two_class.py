"""A cluster of two hardware classes from published GPU figures: the Splitwise case for the simulator and tests.

A prefill-strong class (a new gaming card: much compute, little memory) and a memory-strong class (an older
data-centre card: more memory and as much bandwidth, little compute). Speeds follow a roofline per layer of
the served model (LLaMA-2-70B-like: 80 layers, 0.86 B parameters = 1.72 GB of fp16 weights a layer, GQA with
8 KV heads of 128 = 4096 bytes of KV per token a layer):

    prefill of T tokens, per layer:  weights / bandwidth + T * flops_per_token / (peak_flops * PREFILL_MFU)
    decode of B sessions, per layer: weights / bandwidth + B * (context KV / bandwidth + flops_per_token /
                                     (peak_flops * DECODE_MFU))

Published figures (fp16 dense tensor throughput, memory, bandwidth):
* NVIDIA GeForce RTX 4090: 165.2 TFLOPS fp16 with fp32 accumulate, 24 GB GDDR6X, 1008 GB/s
  (NVIDIA Ada Lovelace GPU architecture whitepaper v1.0, appendix table 2).
* AMD Instinct MI50 (32 GB): 26.5 TFLOPS fp16 peak, 32 GB HBM2, 1024 GB/s (AMD Instinct MI50 datasheet).

Each node's ClusterNode carries what the planner needs (tokens_s_by_layers: decode at the simulator's full
batch; extra "prefill_tokens_s_by_layers", "kv_tokens_by_layers": swarm.planner.phases) and what the simulator
needs (extra "prefill_s_per_layer", "decode_s_per_layer": swarm/sim/timing.py tables).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.planner.cluster import Cluster, ClusterNode, ModelInfo, full_mesh_links
from swarm.planner.split import KV_KEY, PREFILL_KEY
from swarm.types import NodeID

PREFILL_MFU = 0.5  # share of peak compute a large prefill reaches
DECODE_MFU = 0.3  # and a decode batch's matrix-vector products
FULL_BATCH = 32  # the simulator's decode batch cap (SimConfig.max_batch_tokens)
PROMPT_BATCH = 1024  # prompt tokens at which prefill_tokens_s_by_layers is taken
USABLE_MEMORY = 0.9  # of the card's memory, after the CUDA context and activations
KV_RESERVE = 0.15  # of the card's memory kept for KV at the most layers it holds


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    peak_flops: float  # fp16 dense tensor


RTX4090 = Gpu("rtx4090", 24e9, 1008e9, 165.2e12)
MI50 = Gpu("mi50", 32e9, 1024e9, 26.5e12)


@dataclass(frozen=True)
class LayerSpec:
    """One transformer layer of the served model."""

    weight_bytes: float = 1.72e9
    flops_per_token: float = 2 * 0.86e9
    kv_bytes_per_token: float = 4096.0
    mean_context_tokens: float = 763.0 + 232.0 / 2  # the context a decode step reads, on average


MODEL_70B = ModelInfo("llama-70b-class", 80, 8192 * 2, 4)


def prefill_s(gpu: Gpu, layer: LayerSpec, tokens: float) -> float:
    """Seconds to prefill `tokens` prompt tokens through one layer."""
    return layer.weight_bytes / gpu.bandwidth_bytes_s + tokens * layer.flops_per_token / (
        gpu.peak_flops * PREFILL_MFU
    )


def decode_s(gpu: Gpu, layer: LayerSpec, batch: float) -> float:
    """Seconds of one decode iteration of `batch` sessions through one layer."""
    per_token = layer.mean_context_tokens * layer.kv_bytes_per_token / gpu.bandwidth_bytes_s
    per_token += layer.flops_per_token / (gpu.peak_flops * DECODE_MFU)
    return layer.weight_bytes / gpu.bandwidth_bytes_s + batch * per_token


def gpu_node(node_id: str, gpu: Gpu, layer: LayerSpec, num_layers: int) -> ClusterNode:
    """The node's layer cap from memory (KV_RESERVE left for KV), its speed tables and its KV room."""
    usable = gpu.memory_bytes * USABLE_MEMORY
    max_layers = min(int(usable * (1 - KV_RESERVE) // layer.weight_bytes), num_layers)
    decode, prefill, kv = [], [], []
    for k in range(1, max_layers + 1):
        decode.append(FULL_BATCH / (k * decode_s(gpu, layer, FULL_BATCH)))
        prefill.append(PROMPT_BATCH / (k * prefill_s(gpu, layer, PROMPT_BATCH)))
        kv.append(int((usable - k * layer.weight_bytes) / (k * layer.kv_bytes_per_token)))
    extra = {
        "gpu": gpu.name,
        PREFILL_KEY: prefill,
        KV_KEY: kv,
        "prefill_s_per_layer": [[1, prefill_s(gpu, layer, 1)], [4096, prefill_s(gpu, layer, 4096)]],
        "decode_s_per_layer": [[1, decode_s(gpu, layer, 1)], [FULL_BATCH, decode_s(gpu, layer, FULL_BATCH)]],
    }
    return ClusterNode(NodeID(node_id), "r0", max_layers, tuple(decode), extra)


def two_class_cluster(
    prefill_nodes: int = 8,
    decode_nodes: int = 8,
    link_bytes_s: float = 1.25e9,
    prefill_gpu: Gpu = RTX4090,
    decode_gpu: Gpu = MI50,
) -> Cluster:
    """`prefill_nodes` prefill-strong and `decode_nodes` memory-strong cards in one region, a full mesh of
    `link_bytes_s` (10 Gb/s by default) with 1 ms latency."""
    layer = LayerSpec()
    nodes = [
        gpu_node(f"{prefill_gpu.name}-{i}", prefill_gpu, layer, MODEL_70B.num_layers)
        for i in range(prefill_nodes)
    ]
    nodes += [
        gpu_node(f"{decode_gpu.name}-{i}", decode_gpu, layer, MODEL_70B.num_layers)
        for i in range(decode_nodes)
    ]
    return Cluster(MODEL_70B, tuple(nodes), full_mesh_links(nodes, link_bytes_s, 0.001))
