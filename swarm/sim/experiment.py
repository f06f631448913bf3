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
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from swarm.errors import PlanningError
from swarm.planner import synthetic
from swarm.planner.cluster import Cluster, load_cluster
from swarm.planner.graph import max_flow
from swarm.planner.milp import TIME_LIMIT_S
from swarm.planner.replan import ReplanConfig, replan
from swarm.planner.solve import HEURISTICS, solve
from swarm.planner.two_class import two_class_cluster
from swarm.sim.churn import Churn, ChurnEvent, Planner, initially_absent, load_schedule, present_cluster
from swarm.sim.engine import SimConfig, Simulation
from swarm.sim.report import churn_targets, summarize
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import Request, TraceConfig, make_trace
from swarm.types import LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)

PLACEMENTS = ("milp", "search", "greedy", "swarm", "separate")
SCHEDULINGS = ("iwrr", "random", "swarm")
REPLANS = ("local", "scratch")
CHURN_MODES = ("new", "old", "both")
# The churn behaviour of issue 13, each a switch (SimConfig): "new" turns all on, "old" all off.
CHURN_FEATURES = ("mbb", "partial", "handover", "chunked")


@dataclass(frozen=True)
class Experiment:
    """What scripts/simulate.py runs; its options, one for one (their defaults are these fields')."""

    cluster: str  # CLUSTER.json, or helix24 / helix42 / randomN for a synthetic cluster
    mode: str = "online"  # online (Poisson arrivals) or offline (everything at t = 0)
    requests: int = 1000
    placements: tuple[str, ...] = ("milp", "greedy", "swarm")
    schedulings: tuple[str, ...] = ("iwrr", "random", "swarm")
    seed: int = 0
    load: float = 0.75  # online arrival rate as a fraction of the best plan's max flow
    plan_time_limit_s: float = TIME_LIMIT_S  # MILP / search time limit
    reload_s_per_layer: float = 1.0  # churn: time to load one layer
    cache_layer_tokens: int = SimConfig.cache_layer_tokens
    decode_quantum_tokens: int = SimConfig.decode_quantum_tokens
    churn: str | None = None  # SCHEDULE.json, or the name of a bundled one (churn_helix24)
    replan: str = "local"  # churn: "local" (repair, then capped improvement) or "scratch" (full re-solve)
    churn_mode: str = "new"  # churn: "new" (churn_features on), "old" (all off) or "both" (a row of each)
    churn_features: tuple[str, ...] = CHURN_FEATURES  # which of issue 13's behaviours "new" turns on
    reference: bool = True  # churn: also run the trace churn-free on the nodes that remain (window ratios)

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
        if self.churn_mode not in CHURN_MODES:
            raise ValueError(f"churn mode must be one of {', '.join(CHURN_MODES)}, got {self.churn_mode!r}")
        bad_features = [f for f in self.churn_features if f not in CHURN_FEATURES]
        if bad_features:
            raise ValueError(f"bad churn feature {bad_features}: choose from {', '.join(CHURN_FEATURES)}")
        if self.churn is not None:
            schedule_path(self.churn)  # a missing schedule fails here, before any planning


def cluster_from_arg(arg: str) -> Cluster:
    if arg == "helix24":
        return synthetic.helix_24()
    if arg == "helix42":
        return synthetic.helix_42()
    if arg.startswith("random") and arg[6:].isdigit():
        return synthetic.random_cluster(int(arg[6:]), seed=1)
    if arg.startswith("twoclass"):  # twoclass, or twoclassPxD: P prefill-strong and D memory-strong cards
        counts = arg[8:].split("x")
        if arg == "twoclass":
            return two_class_cluster()
        if len(counts) == 2 and all(c.isdigit() for c in counts):
            return two_class_cluster(int(counts[0]), int(counts[1]))
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
    replans: dict[tuple[object, ...], Plan] = field(default_factory=dict)  # re-plans are the same every row


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


def churn_config(base: SimConfig, mode: str, features: tuple[str, ...]) -> SimConfig:
    """The SimConfig of one churn mode: "new" turns `features` on, "old" turns all of them off."""
    on = set(features) if mode == "new" else set()
    return replace(
        base,
        make_before_break="mbb" in on,
        partial_replay="partial" in on,
        kv_handover="handover" in on,
        replay_chunk_tokens=base.replay_chunk_tokens if "chunked" in on else 0,
    )


def run_row(
    exp: Experiment, setup: _Setup, method: str, scheduling: str, mode: str = "new"
) -> dict[str, Any]:
    """One placement x scheduling (x churn mode): the row of report.summarize, plus its wall_s."""
    t0 = time.perf_counter()
    cluster = setup.cluster
    config = churn_config(setup.config, mode, exp.churn_features)
    sim = Simulation(
        cluster, setup.plans[method], router_factory(cluster, scheduling, exp.seed), setup.trace, config
    )
    churn = None
    if setup.events:
        planner = churn_planner(exp, method, setup.replans)
        churn = Churn(sim, setup.events, planner, setup.present, exp.reload_s_per_layer)
    sim.run()
    row = summarize(sim, method, scheduling)
    if churn is not None:
        row["churn_mode"] = mode
        row["churn_events"] = churn.events()
    row["wall_s"] = time.perf_counter() - t0
    logger.info(
        "%s/%s %s: %.1f tokens/s, lost %d, %.1f s wall",
        method,
        scheduling,
        mode if churn else "",
        row["decode_tokens_s"],
        row["lost_requests"],
        row["wall_s"],
    )
    return row


def churn_planner(
    exp: Experiment, method: str, cache: dict[tuple[object, ...], Plan] | None = None
) -> Planner:
    """The re-plan on each churn event: the live planner's decision, or today's full re-solve. Plans are
    memoised on (nodes present, current placement), so every row of an experiment sees the same re-plans
    (the solver's time limit would otherwise make them differ) and solves each once."""
    config = ReplanConfig(method=method, time_limit_s=exp.plan_time_limit_s, seed=exp.seed)
    memo = cache if cache is not None else {}

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

    def planner(c: Cluster, current: dict[NodeID, LayerRange] | None) -> Plan:
        key = (method, exp.replan, tuple(sorted(c.node_by_id)), tuple(sorted((current or {}).items())))
        if key not in memo:
            memo[key] = (local if exp.replan == "local" else scratch)(c, current)
        return memo[key]

    return planner


def reference_rows(exp: Experiment, setup: _Setup, method: str, scheduling: str) -> dict[str, Any]:
    """Per distinct set of nodes left after a leave: the trace served churn-free by those nodes alone, on a
    from-scratch plan (the steady state the churn run's windows are held against). Keyed by the leave's
    time."""
    out: dict[str, Any] = {}
    present, by_set = set(setup.present), {}  # type: ignore[var-annotated]
    for e in setup.events:
        if e.joins:
            present.add(e.node)
            continue
        present.discard(e.node)
        key = frozenset(present)
        if key not in by_set:
            cluster = present_cluster(setup.cluster, set(present))
            plan_key = ("reference", method, tuple(sorted(key)))
            if plan_key not in setup.replans:
                setup.replans[plan_key] = make_plan(cluster, method, exp.plan_time_limit_s)
            plan = setup.replans[plan_key]
            config = churn_config(setup.config, "new", exp.churn_features)
            sim = Simulation(
                cluster, plan, router_factory(cluster, scheduling, exp.seed), setup.trace, config
            )
            row = summarize(sim.run(), method, scheduling)
            by_set[key] = {"nodes": len(present), "max_flow_tokens_s": plan.max_flow_tokens_s}
            by_set[key] |= {k: row[k] for k in ("decode_tokens_s", "throughput_timeline")}
        out[f"{e.time_s:g}"] = by_set[key]
    return out


def run_experiment(exp: Experiment) -> dict[str, Any]:
    """The experiment's result: its settings, wall time and one row per placement x scheduling (x mode)."""
    started = time.perf_counter()
    setup = _setup(exp)
    modes = (("new", "old") if exp.churn_mode == "both" else (exp.churn_mode,)) if setup.events else ("new",)
    rows = [
        run_row(exp, setup, m, s, mode) for m in exp.placements for s in exp.schedulings for mode in modes
    ]
    result: dict[str, Any] = {
        "cluster": exp.cluster,
        "nodes": len(setup.cluster.nodes),
        "mode": exp.mode,
        "requests": exp.requests,
        "arrival_rate_per_s": setup.rate,
        "seed": exp.seed,
        "replan": exp.replan if exp.churn else None,
        "churn_features": list(exp.churn_features) if exp.churn else None,
        "rows": rows,
    }
    if setup.events and exp.reference:
        refs = {(m, s): reference_rows(exp, setup, m, s) for m in exp.placements for s in exp.schedulings}
        result["churn_targets"] = [
            churn_targets(row, refs[(row["placement"], row["scheduling"])]) for row in rows
        ]
        result["references"] = {f"{m}/{s}": v for (m, s), v in refs.items()}
    result["wall_s"] = time.perf_counter() - started
    return result
