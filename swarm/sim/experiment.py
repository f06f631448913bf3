"""One experiment of scripts/simulate.py: a cluster, placements x schedulings, one shared trace -> JSON rows.

Every row replays the same trace (same seed, same arrivals), so rows differ only in placement and scheduling.
Online, the arrival rate is `load` x the best placement's max flow, in requests of average work; offline,
every request arrives at t = 0. With a churn schedule the swarm starts with the nodes present before their
first join, and each event re-plans as the live planner does (replan "local": swarm.planner.replan, repair then
a capped improvement, published only on a clear gain) or from scratch with the row's own method (replan
"scratch", warm-started: the planner before local re-planning).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from swarm.errors import PlanningError
from swarm.planner import synthetic
from swarm.planner.cluster import Cluster, load_cluster
from swarm.planner.graph import max_flow
from swarm.planner.replan import ReplanConfig, replan
from swarm.planner.solve import HEURISTICS, solve
from swarm.sim.churn import Churn, ChurnEvent, Planner, initially_absent, load_schedule, present_cluster
from swarm.sim.engine import SimConfig, Simulation
from swarm.sim.report import summarize
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import Request, TraceConfig, make_trace
from swarm.types import LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)

PLACEMENTS = ("milp", "search", "greedy", "swarm", "separate")
SCHEDULINGS = ("iwrr", "random", "swarm")
REPLANS = ("local", "scratch")


@dataclass(frozen=True)
class Experiment:
    """What scripts/simulate.py runs; its options, one for one."""

    cluster: str  # CLUSTER.json, or helix24 / helix42 / randomN for a synthetic cluster
    mode: str = "online"  # online (Poisson arrivals) or offline (everything at t = 0)
    requests: int = 1000
    placements: tuple[str, ...] = ("milp", "greedy", "swarm")
    schedulings: tuple[str, ...] = ("iwrr", "random", "swarm")
    seed: int = 0
    load: float = 0.75  # online arrival rate as a fraction of the best plan's max flow
    plan_time_limit_s: float = 20.0  # MILP / search time limit
    reload_s_per_layer: float = 1.0  # churn: time to load one layer
    cache_layer_tokens: int = SimConfig.cache_layer_tokens
    decode_quantum_tokens: int = 1
    churn: str | None = None  # SCHEDULE.json, or the name of a bundled one (churn_helix24)
    replan: str = "local"  # churn: "local" (repair, then capped improvement) or "scratch" (full re-solve)

    def __post_init__(self) -> None:
        if self.mode not in ("online", "offline"):
            raise ValueError(f"mode must be online or offline, got {self.mode!r}")
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        for items, allowed, what in (
            (self.placements, PLACEMENTS, "placement"),
            (self.schedulings, SCHEDULINGS, "scheduling"),
        ):
            bad = [x for x in items if x not in allowed]
            if bad or not items:
                raise ValueError(f"bad {what} {bad or list(items)}: choose from {', '.join(allowed)}")
        if self.replan not in REPLANS:
            raise ValueError(f"replan must be one of {', '.join(REPLANS)}, got {self.replan!r}")
        if self.churn is not None:
            schedule_path(self.churn)  # a missing schedule fails here, before any planning


def cluster_from_arg(arg: str) -> Cluster:
    if arg == "helix24":
        return synthetic.helix_24()
    if arg == "helix42":
        return synthetic.helix_42()
    if arg.startswith("random") and arg[6:].isdigit():
        return synthetic.random_cluster(int(arg[6:]), seed=1)
    return load_cluster(arg)


def schedule_path(arg: str) -> Path:
    """A churn schedule's file: `arg` itself when it exists, else the bundled swarm/sim/data/<arg>.json."""
    if Path(arg).exists():
        return Path(arg)
    bundled = resources.files("swarm.sim") / "data" / f"{Path(arg).stem}.json"
    if bundled.is_file():
        return Path(str(bundled))
    raise ValueError(f"no churn schedule {arg!r} (a path, or a name in swarm/sim/data)")


def make_plan(
    cluster: Cluster, method: str, time_limit_s: float, current: dict[NodeID, LayerRange] | None = None
) -> Plan:
    if method in HEURISTICS and current is None:
        # The heuristics' placement through max flow directly: solve() adds nothing for them but its checks.
        return max_flow(cluster, HEURISTICS[method](cluster), method)
    return solve(cluster, method, time_limit_s=time_limit_s, current=current)


def arrival_rate(
    exp: Experiment, best_flow_tokens_s: float, trace_cfg: TraceConfig, config: SimConfig
) -> float:
    """Online requests per second at `exp.load` of the best plan's max flow."""
    # A request's work in decode tokens at full batch: its output plus its prompt at the prefill discount.
    # Counting output alone would offer 1.33x the work at the same --load (763 prompt tokens at 0.1 each on
    # top of 232), so "75% load" would sit at the edge of capacity, with prefills crowding out decode.
    work = trace_cfg.mean_output_tokens + config.timing.prefill_token_cost * trace_cfg.mean_prompt_tokens
    return exp.load * best_flow_tokens_s / work


@dataclass
class _Setup:
    """What every row of an experiment shares."""

    cluster: Cluster
    plans: dict[str, Plan]
    trace: list[Request]
    config: SimConfig
    events: list[ChurnEvent]
    present: set[NodeID]
    rate: float | None


def _setup(exp: Experiment) -> _Setup:
    cluster = cluster_from_arg(exp.cluster)
    events = load_schedule(schedule_path(exp.churn), cluster) if exp.churn else []
    present = {n.id for n in cluster.nodes} - initially_absent(events)
    start_cluster = present_cluster(cluster, present) if events else cluster
    plans: dict[str, Plan] = {}
    for method in exp.placements:
        t0 = time.perf_counter()
        plans[method] = make_plan(start_cluster, method, exp.plan_time_limit_s)
        logger.info(
            "%s: %.1f tokens/s in %.1f s", method, plans[method].max_flow_tokens_s, time.perf_counter() - t0
        )
    best_flow = max(plan.max_flow_tokens_s for plan in plans.values())
    trace_cfg = TraceConfig()
    config = SimConfig(
        cache_layer_tokens=exp.cache_layer_tokens, decode_quantum_tokens=exp.decode_quantum_tokens
    )
    rate = arrival_rate(exp, best_flow, trace_cfg, config) if exp.mode == "online" else None
    trace = make_trace(exp.requests, rate, exp.seed, trace_cfg)
    return _Setup(cluster, plans, trace, config, events, present, rate)


def run_row(exp: Experiment, setup: _Setup, method: str, scheduling: str) -> dict[str, Any]:
    """One placement x scheduling: the row of report.summarize, plus its wall_s."""
    t0 = time.perf_counter()
    cluster = setup.cluster
    sim = Simulation(
        cluster, setup.plans[method], router_factory(cluster, scheduling, exp.seed), setup.trace, setup.config
    )
    if setup.events:
        Churn(sim, setup.events, churn_planner(exp, method), setup.present, exp.reload_s_per_layer)
    sim.run()
    row = summarize(sim, method, scheduling)
    row["wall_s"] = time.perf_counter() - t0
    logger.info(
        "%s/%s: %.1f tokens/s, lost %d, %.1f s wall",
        method,
        scheduling,
        row["decode_tokens_s"],
        row["lost_requests"],
        row["wall_s"],
    )
    return row


def churn_planner(exp: Experiment, method: str) -> Planner:
    """The re-plan on each churn event: the live planner's decision, or today's full re-solve."""
    config = ReplanConfig(method=method, time_limit_s=exp.plan_time_limit_s, seed=exp.seed)

    def local(c: Cluster, current: dict[NodeID, LayerRange] | None) -> Plan:
        plan, why = replan(c, current, config)
        logger.info("re-plan: %s", why)
        if plan is None and current:
            return max_flow(c, current, "kept")  # no clear gain: the current plan stays
        if plan is None:
            raise PlanningError(why)
        return plan

    def scratch(c: Cluster, current: dict[NodeID, LayerRange] | None) -> Plan:
        return make_plan(c, method, exp.plan_time_limit_s, current)

    return local if exp.replan == "local" else scratch


def run_experiment(exp: Experiment) -> dict[str, Any]:
    """The experiment's result: its settings, wall time and one row per placement x scheduling."""
    started = time.perf_counter()
    setup = _setup(exp)
    rows = [run_row(exp, setup, m, s) for m in exp.placements for s in exp.schedulings]
    return {
        "cluster": exp.cluster,
        "nodes": len(setup.cluster.nodes),
        "mode": exp.mode,
        "requests": exp.requests,
        "arrival_rate_per_s": setup.rate,
        "seed": exp.seed,
        "replan": exp.replan if exp.churn else None,
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
