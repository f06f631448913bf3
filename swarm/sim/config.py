"""The simulation's settings that are not in CLUSTER.json."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.sim.timing import TimingDefaults


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulation that are not in CLUSTER.json."""

    prefill_budget_tokens: int = 4096  # prompt tokens one iteration may take in (chunked prefill)
    # Decode tokens per iteration: a micro-batch, so several are in flight in a pipeline. Also the full batch
    # at which derived timing (no tables) runs a node at its tokens_s, the planner's figure.
    max_batch_tokens: int = 32
    cache_layer_tokens: int = 20_000_000  # KV cache of a node without "cache_tokens": tokens x layers it fits
    cache_high_water: float = 0.9  # like the client: a peer fuller than this takes no new session
    client_step_s: float = 0.0  # LM head + sampling on the client per decode step
    client_host: str | None = None  # the client runs on this host (swarm/sim/hosts.py), sharing its cores
    missing_link_latency_s: float = 0.1  # a hop with no link in CLUSTER.json (fallback routes only)
    missing_link_bandwidth_bytes_s: float = 12.5e6
    bucket_s: float = 10.0  # width of the throughput-over-time buckets
    # Decode tokens a session advances per pass through its route. 1 is exact; K > 1 simulates K consecutive
    # steps as one (K x compute, K x link latency and bytes, batch membership fixed for the K steps), which
    # cuts events K-fold for large runs at the price of coarser interleaving.
    decode_quantum_tokens: int = 1
    timing: TimingDefaults = field(default_factory=TimingDefaults)
    # Churn behaviour (swarm/sim/moves.py); False / 0 everywhere is the swarm before issue 13.
    make_before_break: bool = True  # a moved node serves its old sessions while it loads, and drains them
    partial_replay: bool = True  # a failover replays only through the replaced stage(s), from their inputs
    kv_handover: bool = True  # a leaving or moving node streams its sessions' KV caches to a successor
    replay_chunk_tokens: int = 256  # replay tokens one iteration may take in (0: a replay is one prefill)
    # Prompt tokens one iteration may take in next to the decode batch (chunked prefill, as vLLM and Sarathi
    # schedule); 0: a prompt is one prefill job, up to prefill_budget_tokens an iteration.
    prompt_chunk_tokens: int = 0
    # KV bytes per token per layer = 2 (K and V) * kv_heads * head_dim * dtype bytes = 2 * activation bytes
    # * kv_heads / heads: LLaMA-2-70B has 8 KV heads of 64 (the synthetic clusters' 70B class).
    kv_heads_fraction: float = 0.125
