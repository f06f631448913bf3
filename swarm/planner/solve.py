"""The planner's entry point: cluster (+ the live placement) -> Plan, by any method, always valid.

"milp" is the full pipeline, each phase starting from the best placement so far:

  1. the three heuristics (and the current placement, if any) -> best start;
  2. coverage phase, per region (the whole cluster when it has one region): simulated annealing on the
     coverage score, then the coverage integer program over node kinds (coverage_ip.py) warm-started from it;
  3. across regions: annealing scored by the exact max flow, from the best joined placement;
  4. the per-node Helix MILP (milp.py), warm-started, for whatever time is left.

"search" runs phases 1-3 without the integer programs. The best placement found by ANY phase wins, judged by

    max flow (networkx preflow-push on the full cluster) - reload_cost * layers loaded anew,

and the Plan carries the best upper bound we can prove: graph.upper_bound, tightened by the integer
programs' dual bounds where those bound the real problem (see each module). Phases stop once the best score
reaches that bound: nothing beats a proven optimum, and on a small cluster the first heuristic often gets
there (a live planner that spends its whole time limit anyway takes CPU from the peer it runs on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.errors import PlanningError
from swarm.planner.cluster import Cluster
from swarm.planner.coverage_ip import MAX_KINDS, node_kinds, solve_coverage_ip
from swarm.planner.graph import max_flow, upper_bound
from swarm.planner.heuristics import petals_greedy, separate_pipelines, swarm_stages
from swarm.planner.milp import TIME_LIMIT_S, MilpConfig, solve_milp
from swarm.planner.moves import flow_of
from swarm.planner.placement import Placement, check_feasible, check_placement, new_layers, repair
from swarm.planner.search import SearchConfig, anneal
from swarm.types import SINK, SOURCE, Plan

logger = logging.getLogger(__name__)

METHODS = ("milp", "search", "greedy", "swarm", "separate")
HEURISTICS: dict[str, Callable[[Cluster], Placement]] = {
    "greedy": petals_greedy,
    "swarm": swarm_stages,
    "separate": separate_pipelines,
}
SMALL_CLUSTER_NODES = 16  # up to here the Helix MILP can still prove optimality, so it gets more time
OPTIMAL_REL_TOL = 1e-5  # a score this close to the proven bound is optimal (the bound carries float rounding)


@dataclass(frozen=True)
class _Shares:
    """Fractions of the time limit per phase (they sum to 1)."""

    coverage_anneal: float
    coverage_ip: float
    exact_anneal: float
    helix_milp: float


def _shares(cluster: Cluster, method: str, regional: bool) -> _Shares:
    if method == "search":
        return _Shares(0.3, 0.0, 0.7, 0.0) if regional else _Shares(1.0, 0.0, 0.0, 0.0)
    small = len(cluster.nodes) <= SMALL_CLUSTER_NODES
    use_ip = len(node_kinds(cluster)) <= MAX_KINDS or small
    if regional:
        return _Shares(0.2, 0.2 if use_ip else 0.0, 0.4 if use_ip else 0.6, 0.2)
    if small:
        return _Shares(0.2, 0.3, 0.0, 0.5)
    return _Shares(0.35, 0.45, 0.0, 0.2) if use_ip else _Shares(0.8, 0.0, 0.0, 0.2)


class _Best:
    """The best placement so far under the objective, plus what each phase reached (for Plan.extra)."""

    def __init__(self, cluster: Cluster, held: Placement | None, reload_cost: float) -> None:
        self.cluster, self.held, self.reload_cost = cluster, held, reload_cost
        self.score = float("-inf")
        self.plan: Plan | None = None
        self.extra: dict[str, float] = {}
        self.offer_s = 0.0  # the longest one offer() took: time to keep back for judging the last phase

    def offer(self, placement: Placement | None, phase: str | None = None) -> float:
        """Judge a candidate; returns its max flow (-inf when it is missing or cannot be repaired)."""
        if placement is None:
            return float("-inf")
        started = time.perf_counter()
        try:
            placement = repair(self.cluster, placement)
        except PlanningError:
            return float("-inf")
        plan = max_flow(self.cluster, placement, least_delay=False)  # flows by delay: once, in _finish
        score = plan.max_flow_tokens_s - self.reload_cost * new_layers(self.held, placement)
        if phase is not None:
            self.extra[f"{phase}_tokens_s"] = plan.max_flow_tokens_s
        if score > self.score + 1e-9:
            self.score, self.plan = score, plan
        self.offer_s = max(self.offer_s, time.perf_counter() - started)
        return plan.max_flow_tokens_s

    def reaches(self, bound: float) -> bool:
        """True when the best score is a proven optimum (the objective never exceeds the flow bound)."""
        return self.plan is not None and self.score >= bound - OPTIMAL_REL_TOL * max(abs(bound), 1.0)

    @property
    def placement(self) -> Placement:
        if self.plan is None:  # the heuristics always give one; this guards against a future change
            raise PlanningError("no valid starting placement")
        return self.plan.placement


@dataclass
class _Run:
    """One solve: its inputs, its clock, and the best placement and bound so far, shared by the phases."""

    cluster: Cluster
    method: str
    time_limit_s: float
    started: float
    held: Placement | None
    reload_cost: float
    seed: int
    prune_k: int
    best: _Best
    bound: float

    def budget(self, share: float) -> float:
        """Seconds for a phase given its share of the time limit, capped by what is left."""
        # Each phase's result is judged afterwards (an exact max flow, ~0.4 s on 256 nodes), and HiGHS
        # notices its time limit only at its next check: keep time back for both, so that the whole
        # solve ends within time_limit_s.
        reserve = 1.5 * self.best.offer_s + 0.02 * self.time_limit_s
        left = self.time_limit_s - (time.perf_counter() - self.started) - reserve
        return max(0.0, min(share * self.time_limit_s, left))

    def optimal(self) -> bool:
        return self.best.reaches(self.bound)


def solve(
    cluster: Cluster,
    method: str = "milp",
    time_limit_s: float = TIME_LIMIT_S,
    current: Placement | None = None,
    reload_cost: float = 0.0,
    seed: int = 0,
    prune_k: int = 8,
) -> Plan:
    """Plan a placement of the cluster's model.

    method: "milp" (the full pipeline, default), "search" (annealing only), or a single heuristic
    ("greedy", "swarm", "separate"). current: the live placement, to warm-start from and to charge
    reload_cost (tokens/s of objective per layer a node must load anew) against. prune_k: hop links kept per
    node in the Helix MILP. Raises PlanningError only when no valid placement exists.
    """
    if method not in METHODS:
        raise ValueError(f"unknown planning method {method!r}: choose from {', '.join(METHODS)}")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    started = time.perf_counter()
    check_feasible(cluster)
    # Reload is charged against what nodes really hold now; the repaired copy is only a candidate start.
    held = {n: r for n, r in (current or {}).items() if n in cluster.node_by_id} or None
    best = _Best(cluster, held, reload_cost)
    run = _Run(
        cluster, method, time_limit_s, started, held, reload_cost, seed, prune_k, best, upper_bound(cluster)
    )
    if method in HEURISTICS:
        best.offer(HEURISTICS[method](cluster))
    else:
        starts = [h(cluster) for h in HEURISTICS.values()]
        start_flows = [best.offer(placement) for placement in starts]
        best.offer(_usable_current(cluster, current), "current" if current else None)
        regional = len(cluster.regions) > 1
        shares = _shares(cluster, method, regional)
        if regional:
            _regional_phases(run, shares)
        else:
            _anneal_chains(run, shares, starts, start_flows)
            _coverage_ip_phase(run, shares)
        _milp_phase(run)
    return _finish(run)


def _anneal_chains(run: _Run, shares: _Shares, starts: list[Placement], start_flows: list[float]) -> None:
    """One region: two annealing chains on the coverage score, from the best start and the best other."""
    # Two chains, from the best start and from the best other heuristic: which start anneals best
    # varies by cluster and seed by a few percent (measured), so two basins beat one longer run.
    best = run.best
    chain_s = run.budget(shares.coverage_anneal) / 2
    others = [(f, i) for i, (p, f) in enumerate(zip(starts, start_flows, strict=True)) if p != best.placement]
    second = starts[max(others)[1]] if others else None
    for chain, start in enumerate([best.placement, second or best.placement]):
        if run.optimal():
            break
        config = SearchConfig(
            time_limit_s=chain_s, seed=run.seed + chain, reload_cost_tokens_s=run.reload_cost
        )
        best.offer(anneal(run.cluster, start, config, current=run.held), f"search{chain}")


def _coverage_ip_phase(run: _Run, shares: _Shares) -> None:
    """One region: the coverage integer program over node kinds, warm-started from the best placement."""
    if shares.coverage_ip <= 0 or run.optimal():
        return
    # Small clusters afford exact kinds, whose dual bound is then valid even with jittered tables.
    small = len(run.cluster.nodes) <= SMALL_CLUSTER_NODES
    result = solve_coverage_ip(
        run.cluster, run.budget(shares.coverage_ip), run.best.placement, run.held, run.seed, pool=not small
    )
    run.best.offer(result.placement, "coverage_ip")
    if result.bound_valid:
        run.bound = min(run.bound, result.dual_bound_tokens_s)


def _regional_phases(run: _Run, shares: _Shares) -> None:
    """Several regions: each region placed alone first (from scratch only), then annealing on exact flow."""
    if run.held is None and not run.optimal():
        # Place each region on its own first (fast, ignores links), then search jointly from there.
        joined = _per_region(
            run.cluster, run.budget(shares.coverage_anneal), run.budget(shares.coverage_ip), run.seed
        )
        run.best.offer(joined, "regional")
    config = SearchConfig(
        time_limit_s=run.budget(shares.exact_anneal + (0.0 if run.held is None else shares.coverage_anneal)),
        seed=run.seed,
        reload_cost_tokens_s=run.reload_cost,
    )
    if not run.optimal():
        run.best.offer(anneal(run.cluster, run.best.placement, config, current=run.held), "search")


def _milp_phase(run: _Run) -> None:
    """The per-node Helix MILP, warm-started from the best placement, for whatever time is left."""
    milp_s = run.budget(1.0)
    if run.method != "milp" or milp_s <= 0 or run.optimal():
        return
    config = MilpConfig(
        time_limit_s=milp_s, prune_k=run.prune_k, reload_cost_tokens_s=run.reload_cost, seed=run.seed
    )
    result = solve_milp(
        run.cluster, config, warm_start=run.best.placement, current=run.held, target_tokens_s=run.bound
    )
    run.best.offer(result.placement, "milp")
    if result.dual_bound_valid:
        run.bound = min(run.bound, result.dual_bound_tokens_s)


def _finish(run: _Run) -> Plan:
    """The best placement as a checked Plan with the tightest bound proven."""
    plan = run.best.plan
    if plan is None:
        raise PlanningError("no planning phase produced a valid placement")
    check_placement(run.cluster, plan.placement)
    # The best placement's flow is itself a lower bound on the optimum; a bound below it is rounding.
    bound = max(run.bound, plan.max_flow_tokens_s)
    solve_s = time.perf_counter() - run.started
    logger.info(
        "planned %s: %.1f tokens/s, bound %.1f (%.0f%%), %d nodes busy, %.1f s",
        run.method,
        plan.max_flow_tokens_s,
        bound,
        100.0 * plan.max_flow_tokens_s / bound if bound > 0 else 0.0,
        len(plan.placement),
        solve_s,
    )
    return Plan(
        method=run.method,
        placement=plan.placement,
        max_flow_tokens_s=plan.max_flow_tokens_s,
        flows=max_flow(run.cluster, plan.placement).flows,  # the least-delay max flow (graph.max_flow)
        upper_bound_tokens_s=bound,
        solve_s=solve_s,
        extra=run.best.extra,
    )


def _per_region(cluster: Cluster, anneal_s: float, ip_s: float, seed: int) -> Placement | None:
    """Each region that can hold the model alone is placed alone (coverage score: links inside a region are
    fast), so tokens stay in one region from first layer to last. Time is shared in proportion to size.
    None when no region can hold the model alone."""
    joined: Placement = {}
    for i, region in enumerate(cluster.regions):
        members = tuple(n for n in cluster.nodes if n.region == region)
        if sum(cluster.layer_cap(n) for n in members) < cluster.model.num_layers:
            continue
        ids = {n.id for n in members}
        links = tuple(lk for lk in cluster.links if lk.src in ids | {SOURCE} and lk.dst in ids | {SINK})
        sub = Cluster(cluster.model, members, links)
        share = len(members) / len(cluster.nodes)
        start = max((h(sub) for h in HEURISTICS.values()), key=lambda p: flow_of(sub, p))
        placed = anneal(
            sub, start, SearchConfig(time_limit_s=anneal_s * share, seed=seed + i, exact_flow=False)
        )
        if ip_s > 0:
            found = solve_coverage_ip(sub, ip_s * share, placed, None, seed + i).placement
            if found is not None and flow_of(sub, found) > flow_of(sub, placed):
                placed = found
        joined.update(placed)
    return joined or None


def _usable_current(cluster: Cluster, current: Placement | None) -> Placement | None:
    """The live placement restricted to nodes still in the cluster, repaired to be valid (None if absent)."""
    if not current:
        return None
    kept = {n: r for n, r in current.items() if n in cluster.node_by_id and r.end <= cluster.model.num_layers}
    try:
        return repair(cluster, kept)
    except PlanningError:
        return None
