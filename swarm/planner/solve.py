"""The planner's entry point: cluster (+ the live placement) -> Plan, by any method, always valid.

"milp" is the full pipeline: the three heuristics (and the current placement, if any) seed a simulated
annealing search scored by max flow; the Helix MILP then starts from the best placement and tries to
improve it until the time limit. The best placement found by ANY method wins, judged by

    max flow (networkx preflow-push on the full cluster) - reload_cost_tokens_s * layers loaded anew,

and the Plan carries the best upper bound we can prove: the cluster bound of graph.upper_bound, tightened by
the MILP's dual bound when that bound is valid for the real problem (no links pruned, no reload term).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from swarm.errors import PlanningError
from swarm.planner.cluster import Cluster
from swarm.planner.graph import max_flow, upper_bound
from swarm.planner.heuristics import petals_greedy, separate_pipelines, swarm_stages
from swarm.planner.milp import MilpConfig, solve_milp
from swarm.planner.placement import Placement, check_feasible, check_placement, new_layers, repair
from swarm.planner.search import SearchConfig, anneal
from swarm.types import Plan

logger = logging.getLogger(__name__)

METHODS = ("milp", "search", "greedy", "swarm", "separate")
HEURISTICS: dict[str, Callable[[Cluster], Placement]] = {
    "greedy": petals_greedy,
    "swarm": swarm_stages,
    "separate": separate_pipelines,
}
# Share of the time limit that method "milp" gives the annealer before the MILP. Small clusters leave the
# MILP half (it can prove optimality there); on large ones it rarely improves a good start, search does.
SMALL_CLUSTER_NODES = 16


def _search_share(cluster: Cluster) -> float:
    return 0.5 if len(cluster.nodes) <= SMALL_CLUSTER_NODES else 0.8


def solve(
    cluster: Cluster,
    method: str = "milp",
    time_limit_s: float = 60.0,
    current: Placement | None = None,
    reload_cost: float = 0.0,
    seed: int = 0,
    prune_k: int = 8,
) -> Plan:
    """Plan a placement of the cluster's model.

    method: "milp" (search + MILP, the default), "search" (annealing only), or a single heuristic
    ("greedy", "swarm", "separate"). current: the live placement, to warm-start from and to charge
    reload_cost (tokens/s of objective per layer a node must load anew) against. prune_k: hop links kept per
    node in the MILP. Raises PlanningError only when no valid placement exists.
    """
    if method not in METHODS:
        raise ValueError(f"unknown planning method {method!r}: choose from {', '.join(METHODS)}")
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    started = time.perf_counter()
    check_feasible(cluster)
    # Reload is charged against what nodes really hold now; the repaired copy is only a candidate start.
    held = {n: r for n, r in (current or {}).items() if n in cluster.node_by_id} or None
    live = _usable_current(cluster, current)

    def objective(placement: Placement) -> tuple[float, Plan]:
        plan = max_flow(cluster, placement)
        return plan.max_flow_tokens_s - reload_cost * new_layers(held, placement), plan

    if method in HEURISTICS:
        best_plan = objective(HEURISTICS[method](cluster))[1]
        bound = upper_bound(cluster)
        extra: dict[str, float] = {}
    else:
        candidates = [h(cluster) for h in HEURISTICS.values()]
        if live is not None:
            candidates.insert(0, live)
        scored = sorted((objective(p) for p in candidates), key=lambda sp: -sp[0])
        best_score, best_plan = scored[0]
        search_s = time_limit_s * (_search_share(cluster) if method == "milp" else 1.0)
        search_s = max(0.0, min(search_s, time_limit_s - (time.perf_counter() - started)))
        found = anneal(
            cluster,
            best_plan.placement,
            SearchConfig(time_limit_s=search_s, seed=seed, reload_cost_tokens_s=reload_cost),
            current=held,
        )
        found_score, found_plan = objective(found)
        if found_score > best_score:
            best_score, best_plan = found_score, found_plan
        bound = upper_bound(cluster)
        extra = {"search_tokens_s": found_plan.max_flow_tokens_s}
        if method == "milp":
            left_s = time_limit_s - (time.perf_counter() - started)
            result = solve_milp(
                cluster,
                MilpConfig(time_limit_s=max(left_s, 0.1), prune_k=prune_k, reload_cost_tokens_s=reload_cost),
                warm_start=best_plan.placement,
                current=held,
                target_tokens_s=bound,
            )
            extra["milp_status_ok"] = 1.0 if result.placement is not None else 0.0
            if result.placement is not None:
                milp_score, milp_plan = objective(repair(cluster, result.placement))
                extra["milp_tokens_s"] = milp_plan.max_flow_tokens_s
                if milp_score > best_score + 1e-9:
                    best_score, best_plan = milp_score, milp_plan
            if result.dual_bound_valid:
                extra["milp_bound_tokens_s"] = result.dual_bound_tokens_s
                bound = min(bound, result.dual_bound_tokens_s)
    check_placement(cluster, best_plan.placement)
    # The best placement's flow is itself a lower bound on the optimum, so the bound cannot be below it.
    bound = max(bound, best_plan.max_flow_tokens_s)
    solve_s = time.perf_counter() - started
    logger.info(
        "planned %s: %.1f tokens/s, bound %.1f (%.0f%%), %d nodes busy, %.1f s",
        method,
        best_plan.max_flow_tokens_s,
        bound,
        100.0 * best_plan.max_flow_tokens_s / bound if bound > 0 else 0.0,
        len(best_plan.placement),
        solve_s,
    )
    return Plan(
        method=method,
        placement=best_plan.placement,
        max_flow_tokens_s=best_plan.max_flow_tokens_s,
        flows=best_plan.flows,
        upper_bound_tokens_s=bound,
        solve_s=solve_s,
        extra=extra,
    )


def _usable_current(cluster: Cluster, current: Placement | None) -> Placement | None:
    """The live placement restricted to nodes still in the cluster, repaired to be valid (None if absent)."""
    if not current:
        return None
    kept = {n: r for n, r in current.items() if n in cluster.node_by_id and r.end <= cluster.model.num_layers}
    try:
        return repair(cluster, kept)
    except PlanningError:
        return None
