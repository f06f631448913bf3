"""Re-planning a live swarm: repair, then improve, with movement priced in.

A volunteer swarm changes all day; a from-scratch re-solve after one leave moved 17-22 of helix24's 23
remaining nodes (contiguous ranges ripple), and every moved node drops its sessions. So, in this order:

  1. local_repair: after a leave, restore coverage locally: a spare (a node whose layers are all held twice,
     or an idle one) takes the gap, else the fewest neighbours extend over it (each within its max_layers).
     None when no local repair restores a full route: only then does a full solve run at once.
  2. improve: the Helix MILP from the current placement (warm start) with a keep binary per node, at most
     max_moves nodes moved, and a price on every node whose range changes (milp.py).
  3. match_ranges: the new ranges are dealt to nodes to maximise the layers they already hold (an
     assignment problem: scipy's linear_sum_assignment), so a permutation of held ranges moves nobody.
  4. add_spares: nodes with free max_layers grow toward the least-replicated layers while the max flow does
     not drop, until every layer has 1 + spare_replicas holders where memory allows: a leave then needs no move.
  5. publish_reason: a new plan replaces the current one only when that restores coverage or raises the max
     flow, scored on the same snapshot, by more than gain_fraction.

Pure: no I/O, no clock but the solver's time limit, seeds are parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import linear_sum_assignment

from swarm.errors import PlanningError
from swarm.planner.cluster import Cluster
from swarm.planner.graph import max_flow
from swarm.planner.milp import TIME_LIMIT_S, MilpConfig, solve_milp
from swarm.planner.moves import FLOW_TOL, add_spares, best_of, flow_of, greedy_moves, moved_nodes
from swarm.planner.placement import Placement, placement_problems, repair
from swarm.planner.solve import solve
from swarm.types import LayerRange, NodeID, Plan, coverage


@dataclass(frozen=True)
class ReplanConfig:
    """How the live planner (and the simulator's churn runs) re-plan; see swarm/peer/config.py PlannerConfig."""

    method: str = "milp"  # solve()'s method for a from-scratch plan
    time_limit_s: float = TIME_LIMIT_S  # per solve
    max_moves: int = 2  # nodes holding a range that one improvement may move
    move_cost_fraction: float = 0.01  # price of one moved node, as a fraction of the current max flow
    reload_cost_tokens_s: float = 0.1  # price per layer a node loads anew
    spare_replicas: int = 1  # holders per layer beyond the first, where memory allows
    gain_fraction: float = 0.05  # publish an improvement only above this relative gain (see PlannerConfig)
    match_loss_fraction: float = 0.01  # matching may lose this much flow to keep nodes on their layers
    seed: int = 0
    node_limit: int | None = None  # MILP branch-and-bound nodes (deterministic tests)


def plan_problem(cluster: Cluster, placement: Placement) -> str | None:
    """Why the placement cannot serve this cluster (None: it can)."""
    gone = sorted(n for n in placement if n not in cluster.node_by_id)
    if gone:
        return f"planned peers gone: {gone}"
    problems = placement_problems(cluster, placement)
    return "; ".join(problems) if problems else None


def _still_held(cluster: Cluster, held: Placement) -> Placement:
    """What nodes still in the cluster hold, each range clipped to what the node fits now."""
    out: Placement = {}
    for node_id, r in held.items():
        node = cluster.node_by_id.get(node_id)
        if node is None or r.start >= cluster.model.num_layers:
            continue
        end = min(r.end, cluster.model.num_layers, r.start + cluster.layer_cap(node))
        if end > r.start:
            out[node_id] = LayerRange(r.start, end)
    return out


def _first_gap(cluster: Cluster, placement: Placement) -> tuple[int, int] | None:
    counts = coverage(placement.values(), cluster.model.num_layers)
    if 0 not in counts:
        return None
    start = counts.index(0)
    end = start
    while end < len(counts) and counts[end] == 0:
        end += 1
    return start, end


def _spares(cluster: Cluster, placement: Placement) -> list[NodeID]:
    """Idle nodes, and nodes whose every layer another node also holds: moving them uncovers nothing."""
    counts = coverage(placement.values(), cluster.model.num_layers)
    return [
        n.id
        for n in cluster.nodes
        if cluster.layer_cap(n) > 0
        and (n.id not in placement or min(counts[placement[n.id].start : placement[n.id].end]) >= 2)
    ]


def _cover_with_spare(cluster: Cluster, placement: Placement, gap: tuple[int, int]) -> Placement | None:
    """One spare takes the gap (or as much of it as it fits, from the gap's start)."""
    options = []
    for node_id in _spares(cluster, placement):
        cap = cluster.layer_cap(cluster.node_by_id[node_id])
        options.append({**placement, node_id: LayerRange(gap[0], min(gap[1], gap[0] + cap))})
    return best_of(cluster, options)


def _cover_with_neighbours(cluster: Cluster, placement: Placement, gap: tuple[int, int]) -> Placement | None:
    """The fewest nodes next to the gap extend over it: one from either side, else one from each side."""
    p, q = gap
    left = [(n, r) for n, r in placement.items() if r.end == p]  # extend rightwards
    right = [(n, r) for n, r in placement.items() if r.start == q]  # extend leftwards
    cap = {n: cluster.layer_cap(cluster.node_by_id[n]) for n in placement}
    singles = [{**placement, n: LayerRange(r.start, q)} for n, r in left if q - r.start <= cap[n]]
    singles += [{**placement, n: LayerRange(p, r.end)} for n, r in right if r.end - p <= cap[n]]
    if singles:
        return best_of(cluster, singles)
    pairs = []
    for a, ra in left:
        reach = ra.start + cap[a]  # a covers [p, reach)
        for b, rb in right:
            if rb.end - cap[b] <= reach:
                pairs.append({**placement, a: LayerRange(ra.start, reach), b: LayerRange(reach, rb.end)})
    return best_of(cluster, pairs)


def local_repair(cluster: Cluster, held: Placement) -> Placement | None:
    """Restore full coverage with local changes only (spares first, then neighbours); None if it cannot.

    Nodes no longer in the cluster are dropped and ranges clipped to what nodes fit now; everyone else keeps
    their range unless chosen to cover a gap.
    """
    placement = _still_held(cluster, held)
    for _ in range(cluster.model.num_layers):
        gap = _first_gap(cluster, placement)
        if gap is None:
            return placement if flow_of(cluster, placement) > 0 else None
        fixed = _cover_with_spare(cluster, placement, gap) or _cover_with_neighbours(cluster, placement, gap)
        if fixed is None:
            return None
        placement = fixed
    return None


def match_ranges(cluster: Cluster, held: Placement, placement: Placement, loss_fraction: float) -> Placement:
    """Deal the placement's ranges to nodes so that they reuse the most layers they already hold.

    An assignment problem (nodes x ranges, weight = layers in common, a range a node cannot fit forbidden).
    Every node may take any range; the result is kept if it loses at most loss_fraction of the max flow
    (nodes differ in speed), else the ranges are only permuted among interchangeable nodes.
    """
    if not held:
        return placement
    for groups in (_all_nodes(cluster), _identical(cluster)):
        out = dict(placement)
        for group in groups:
            out = _assign(cluster, held, out, group)
        if flow_of(cluster, out) >= (1.0 - loss_fraction) * flow_of(cluster, placement) - FLOW_TOL:
            return out
    return placement


def _all_nodes(cluster: Cluster) -> list[list[NodeID]]:
    return [[n.id for n in cluster.nodes]]


def _identical(cluster: Cluster) -> list[list[NodeID]]:
    groups: dict[tuple[int, tuple[float, ...]], list[NodeID]] = {}
    for n in cluster.nodes:
        groups.setdefault((cluster.layer_cap(n), n.tokens_s_by_layers), []).append(n.id)
    return list(groups.values())


def _assign(cluster: Cluster, held: Placement, placement: Placement, group: list[NodeID]) -> Placement:
    """Max-weight assignment of the group's ranges (idle counts as a range of nothing) to its nodes."""
    ranges = [placement.get(n) for n in group]
    weight = np.zeros((len(group), len(ranges)))
    for i, node_id in enumerate(group):
        cap, old = cluster.layer_cap(cluster.node_by_id[node_id]), held.get(node_id)
        for j, r in enumerate(ranges):
            if r is not None and len(r) > cap:
                weight[i, j] = -1e9  # cannot fit
            elif r is not None and old is not None:
                both = r.intersect(old)
                # Taking back exactly the held range beats any other overlap of the same size.
                weight[i, j] = (len(both) if both else 0) + (0.5 if r == old else 0.0)
            elif r is None and old is None:
                weight[i, j] = 0.5  # idle stays idle
    rows, cols = linear_sum_assignment(weight, maximize=True)
    out = {n: r for n, r in placement.items() if n not in group}
    for i, j in zip(rows, cols, strict=True):
        r = ranges[j]
        if weight[i, j] < 0:
            return placement  # no feasible dealing: keep the ranges where they were
        if r is not None:
            out[group[i]] = r
    return out


def _score(
    cluster: Cluster, held: Placement, placement: Placement, config: ReplanConfig, move_cost: float
) -> float:
    """The improvement's objective: max flow less the price of moved nodes and of layers loaded anew."""
    loaded = 0
    for n, r in placement.items():
        both = r.intersect(held[n]) if n in held else None
        loaded += len(r) - (len(both) if both else 0)
    moves = len(moved_nodes(held, placement))
    return flow_of(cluster, placement) - move_cost * moves - config.reload_cost_tokens_s * loaded


def improve(cluster: Cluster, held: Placement, config: ReplanConfig) -> Plan:
    """The best placement within max_moves moves of `held` (repaired first when broken), matched, with spares.

    Raises PlanningError only when no valid placement exists.
    """
    now = _still_held(cluster, held)
    start = local_repair(cluster, now)
    if start is None:
        start = repair(cluster, now)  # not local, but valid; the MILP's cap then allows its moves
    move_cost = config.move_cost_fraction * flow_of(cluster, start)
    budget = max(config.max_moves, len(moved_nodes(now, start)))
    # Idle nodes (joiners) take layers freely; then the few best moves of busy ones: the MILP's warm start.
    idle = [n.id for n in cluster.nodes if n.id not in start and cluster.layer_cap(n) > 0]
    searched = greedy_moves(cluster, start, idle, len(idle))
    unmoved = [n for n in now if searched.get(n) == now[n]]
    searched = greedy_moves(cluster, searched, unmoved, budget - len(moved_nodes(now, searched)))
    if _score(cluster, now, searched, config, move_cost) > _score(cluster, now, start, config, move_cost):
        start = searched
    milp = MilpConfig(
        time_limit_s=config.time_limit_s,
        reload_cost_tokens_s=config.reload_cost_tokens_s,
        seed=config.seed,
        max_moves=config.max_moves,
        move_cost_tokens_s=move_cost,
        node_limit=config.node_limit,
    )
    found = solve_milp(cluster, milp, warm_start=start, current=now).placement
    best = start
    if found is not None and not placement_problems(cluster, found):
        if _score(cluster, now, found, config, move_cost) > _score(cluster, now, start, config, move_cost):
            best = found
    best = match_ranges(cluster, now, best, config.match_loss_fraction)
    best = add_spares(cluster, best, config.spare_replicas, now, budget)
    return max_flow(cluster, best, "replan")


def from_scratch(cluster: Cluster, held: Placement | None, config: ReplanConfig) -> Plan:
    """solve() as before (no cap on moves), then matched to what nodes hold and given spares."""
    plan = solve(
        cluster,
        config.method,
        time_limit_s=config.time_limit_s,
        current=held or None,
        reload_cost=config.reload_cost_tokens_s,
        seed=config.seed,
    )
    placement = match_ranges(cluster, held or {}, plan.placement, config.match_loss_fraction)
    placement = add_spares(cluster, placement, config.spare_replicas)
    return max_flow(cluster, placement, plan.method)


def publish_reason(
    cluster: Cluster, current: Placement | None, candidate: Plan, gain_fraction: float
) -> str | None:
    """Why `candidate` should replace the current placement (None: keep it, no thrashing)."""
    if not current:
        return "no plan yet"
    problem = plan_problem(cluster, current)
    if problem is not None:
        return None if plan_problem(cluster, candidate.placement) else f"restores coverage ({problem})"
    now_tokens_s = flow_of(cluster, current)
    if candidate.max_flow_tokens_s > now_tokens_s * (1.0 + gain_fraction):
        return f"max flow {now_tokens_s:.1f} -> {candidate.max_flow_tokens_s:.1f} tokens/s"
    joiners = sorted(n for n in candidate.placement if n not in current)
    if joiners and not moved_nodes(current, candidate.placement):
        if candidate.max_flow_tokens_s >= now_tokens_s * (1.0 - FLOW_TOL):
            return f"idle peers {joiners} take layers, nobody serving moves"  # free: no session moves
    return None


def first_plan(cluster: Cluster, held: Placement, config: ReplanConfig) -> Plan:
    """The first plan of a swarm whose peers already hold layers (their join ranges).

    What they hold, improved within max_moves, unless a from-scratch plan (matched to the held ranges) beats
    it by gain_fraction: peers keep their join ranges when those are about as good.
    """
    half = replace(config, time_limit_s=config.time_limit_s / 2)  # two solves within one time limit
    scratch = from_scratch(cluster, held, half)
    try:
        kept = improve(cluster, held, half)
    except PlanningError:
        return scratch
    better = scratch.max_flow_tokens_s > kept.max_flow_tokens_s * (1.0 + config.gain_fraction)
    return scratch if better else kept


def replan(
    cluster: Cluster, current: Placement | None, config: ReplanConfig, first: bool = False
) -> tuple[Plan | None, str]:
    """One re-planning decision: (the plan to publish or None to keep the current one, why).

    A broken placement is repaired locally when it can be; otherwise (and to improve a working one) the
    capped, priced MILP runs from it. With no current placement, the plan is solved from scratch; `first`:
    `current` is only what peers hold (no plan was published yet), and a plan is always returned.
    """
    if not current:
        return from_scratch(cluster, None, config), "no plan yet"
    if first:
        return first_plan(cluster, current, config), "no plan yet"
    problem = plan_problem(cluster, current)
    if problem is not None:
        repaired = local_repair(cluster, current)
        if repaired is not None:
            return max_flow(cluster, repaired, "repair"), f"repaired locally ({problem})"
    try:
        candidate = improve(cluster, current, config)
    except PlanningError as e:
        return None, f"cannot plan: {e}"
    why = publish_reason(cluster, current, candidate, config.gain_fraction)
    if why is None:
        # Not worth its moves: idle peers (joiners) may still take layers, moving nobody who serves.
        still = _still_held(cluster, current)
        joined = add_spares(cluster, still, config.spare_replicas, still, budget=0)
        candidate = max_flow(cluster, joined, "replan")
        why = publish_reason(cluster, current, candidate, config.gain_fraction)
    return (candidate, why) if why is not None else (None, "no clear gain")
