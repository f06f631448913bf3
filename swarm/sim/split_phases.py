"""Split phases against single routes on one cluster: scripts/simulate.py --split-phases.

Single routes run today's plan (every session prefills and decodes on one route). Split runs the plan of
swarm.planner.split on the same cluster: a session prefills on a route over the plan's `flows`, its KV moves to
a route over `decode_flows` (each prefill stage sends the layers it ran to the decode stages holding them,
bytes over each link's bandwidth, queued FIFO behind other transfers: swarm/sim/sessions.py), then it decodes
there. Both replay the same traces with IWRR routing:

* throughput: offline (every request at t = 0), generated tokens per second while requests still wait for a
  route (whole throughput buckets up to the last admission: the swarm saturated, without the drain at the end,
  where the few longest outputs set the time);
* latency: online, Poisson arrivals at `load` x the requests/s single routes served offline (both at the same
  rate, one every single routes can take): time to first token (TTFT) and each request's mean time between
  tokens (TBT, which for split includes the KV move before the second token), p50 and p90.

sim_throughput_ratio and sim_ttft_p90_ratio are split over single (issue 56's targets: >= 1.3 and <= 1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from swarm.planner.cluster import Cluster
from swarm.planner.solve import solve
from swarm.planner.split import SplitConfig, split_plan
from swarm.sim.config import SimConfig
from swarm.sim.engine import Simulation
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import TraceConfig, make_trace
from swarm.types import Plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PhaseComparison:
    """What one --split-phases run compares (scripts/simulate.py's options)."""

    requests: int = 300
    seed: int = 0
    load: float = 0.7  # online arrivals as a fraction of the requests/s single routes served offline
    plan_time_limit_s: float = 5.0
    decode_quantum_tokens: int = 1
    split: SplitConfig = SplitConfig()
    measured_session_rate: bool = True  # plan the split with the decode rate sessions get on single routes
    prompt_chunk_tokens: int = 0  # SimConfig.prompt_chunk_tokens for both (0: whole prompts, the default)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(cluster: Cluster, plan: Plan, rate_per_s: float | None, cmp: PhaseComparison) -> dict[str, Any]:
    """One run of the trace on `plan`: throughput and latency figures."""
    trace = make_trace(cmp.requests, rate_per_s, cmp.seed)
    config = SimConfig(
        decode_quantum_tokens=cmp.decode_quantum_tokens, prompt_chunk_tokens=cmp.prompt_chunk_tokens
    )
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", cmp.seed), trace, config).run()
    req = sim.requests
    done = [r for r in range(len(trace)) if req.done_s[r] >= 0]
    span_s = max((req.done_s[r] for r in done), default=0.0) - min(t.arrival_s for t in trace)
    ttft = [req.first_token_s[r] - trace[r].arrival_s for r in done]
    tbt = [
        (req.done_s[r] - req.first_token_s[r]) / (trace[r].output_tokens - 1)
        for r in done
        if trace[r].output_tokens > 1
    ]
    moves = sim.counters.phase_moves
    bucket_s = sim.config.bucket_s
    whole = int(sim.sessions.last_admit_s / bucket_s)
    saturated = sum(sim.client.buckets[:whole]) / (whole * bucket_s) if whole > 0 else None
    return {
        "tokens_s": sum(req.generated) / span_s if span_s > 0 else 0.0,
        "tokens_s_saturated": saturated,
        "requests_s": len(done) / span_s if span_s > 0 else 0.0,
        "completed": len(done),
        "ttft_s": {"p50": quantile(ttft, 0.5), "p90": quantile(ttft, 0.9)},
        "tbt_s": {"p50": quantile(tbt, 0.5), "p90": quantile(tbt, 0.9)},
        "kv_moves": moves,
        "kv_move_s_mean": sim.counters.phase_move_s / moves if moves else 0.0,
        "kv_move_bytes_mean": sim.counters.phase_move_bytes / moves if moves else 0.0,
    }


def compare_phases(cluster: Cluster, cmp: PhaseComparison) -> dict[str, Any]:
    """Plans both ways, runs both offline and online, and the ratios split over single."""
    started = time.perf_counter()
    single = solve(cluster, "milp", time_limit_s=cmp.plan_time_limit_s)
    offline = {"single": measure(cluster, single, None, cmp)}
    capacity_tokens_s = _saturated(offline["single"])
    rate = cmp.load * capacity_tokens_s / TraceConfig().mean_output_tokens
    online = {"single": measure(cluster, single, rate, cmp)}
    config = cmp.split
    if cmp.measured_session_rate and online["single"]["tbt_s"]["p50"] > 0:
        # The planner's decode tokens/s per session: what sessions get on today's routes (a client measures it).
        config = replace(config, session_tokens_s=1.0 / online["single"]["tbt_s"]["p50"])
    split = split_plan(cluster, single, config)
    offline["split"] = measure(cluster, split, None, cmp) if split.decode_flows else offline["single"]
    online["split"] = measure(cluster, split, rate, cmp) if split.decode_flows else online["single"]

    def ratio(a: float | None, b: float | None) -> float:
        return a / b if a is not None and b else 0.0

    return {
        "split_planned": bool(split.decode_flows),
        "planner_session_tokens_s": config.session_tokens_s,
        "planned_requests_s": {
            "single": split.extra.get("single_requests_s"),
            "split": split.extra.get("split_requests_s"),
        },
        "arrival_rate_per_s": rate,
        "offline": offline,
        "online": online,
        "sim_throughput_ratio": ratio(_saturated(offline["split"]), _saturated(offline["single"])),
        "sim_ttft_p90_ratio": ratio(online["split"]["ttft_s"]["p90"], online["single"]["ttft_s"]["p90"]),
        "sim_ttft_p50_ratio": ratio(online["split"]["ttft_s"]["p50"], online["single"]["ttft_s"]["p50"]),
        "sim_tbt_p50_ratio": ratio(online["split"]["tbt_s"]["p50"], online["single"]["tbt_s"]["p50"]),
        "sim_tbt_p90_ratio": ratio(online["split"]["tbt_s"]["p90"], online["single"]["tbt_s"]["p90"]),
        "wall_s": time.perf_counter() - started,
    }


def _saturated(run: dict[str, Any]) -> float:
    """Tokens/s while requests still waited (whole tokens/s over the run when that window is under a bucket)."""
    return float(run["tokens_s_saturated"] or run["tokens_s"])
