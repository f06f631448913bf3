"""Few moves and spare replicas: the searches behind swarm.planner.replan.

The best few moves: a greedy search for at most max_moves nodes to move, each to its best range.

The Helix MILP with a cap on moves (milp.py) rarely improves its warm start on 24 nodes within seconds
(measured on helix24 after a leave: no gain in 8 s), so this search gives it a good start. Each step tries
every movable node at every range it fits and keeps the single move that raises the coverage score most
(min over layers of the summed throughput holding it; the max flow when links do not bind), breaking ties
by fewer layers at that minimum, so that two moves can lift a bottleneck that one alone cannot. With the
node's own contribution taken out, every range of length k is scored at once by sliding-window minima:
O(L * cap^2) per node, ~0.1 s for helix24. Candidates are then judged by the exact max flow by the caller.

Spare replicas (add_spares): nodes with free max_layers grow toward the least-replicated layers, and idle
nodes take the weakest layers, each step kept only if the max flow does not drop.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from swarm.planner.cluster import Cluster
from swarm.planner.graph import coverage_score, max_flow
from swarm.planner.placement import Placement
from swarm.types import LayerRange, NodeID, coverage

FLOW_TOL = 1e-6  # relative: flows this close are equal (max flow is computed in milli-tokens/s)


def moved_nodes(held: Placement, placement: Placement) -> list[NodeID]:
    """Nodes that hold a range now and would hold another (or none): the ones whose sessions move."""
    return sorted(n for n, r in held.items() if placement.get(n) != r)


def flow_of(cluster: Cluster, placement: Placement) -> float:
    return max_flow(cluster, placement, least_delay=False).max_flow_tokens_s


EXACT_CANDIDATES = 8  # options judged by the exact max flow (~0.4 s each on 256 nodes); the rest by coverage


def shortlist(cluster: Cluster, options: list[Placement]) -> list[Placement]:
    """The options with the best coverage scores (cheap), best first, so few need an exact max flow."""
    ranked = sorted(enumerate(options), key=lambda t: (-coverage_score(cluster, t[1]), t[0]))
    return [p for _, p in ranked[:EXACT_CANDIDATES]]


def best_of(cluster: Cluster, options: list[Placement]) -> Placement | None:
    """The option with the highest max flow among the shortlist (the first among equals)."""
    scored = [(flow_of(cluster, p), -i, p) for i, p in enumerate(shortlist(cluster, options))]
    return max(scored, key=lambda t: (t[0], t[1]))[2] if scored else None


def layer_throughput(cluster: Cluster, placement: Placement) -> np.ndarray:
    """Summed tokens/s of the nodes holding each layer."""
    out = np.zeros(cluster.model.num_layers)
    for node_id, r in placement.items():
        out[r.start : r.end] += cluster.node_by_id[node_id].tokens_s(len(r))
    return out


def _key(per_layer: np.ndarray) -> tuple[float, int]:
    low = float(per_layer.min())
    return round(low, 6), -int(np.sum(per_layer <= low + 1e-9))


def best_moves(
    cluster: Cluster, placement: Placement, movable: list[NodeID], top: int
) -> list[tuple[tuple[float, int], NodeID, LayerRange]]:
    """The `top` single moves (key after the move, node, new range) that raise the coverage key most."""
    per_layer = layer_throughput(cluster, placement)
    now = _key(per_layer)
    level = now[0]  # the minimum now: a move that does not lift it should shrink its count
    num_layers = cluster.model.num_layers
    found: list[tuple[tuple[float, int], NodeID, LayerRange]] = []
    for node_id in movable:
        node = cluster.node_by_id[node_id]
        base = per_layer.copy()
        old = placement.get(node_id)
        if old is not None:
            base[old.start : old.end] -= node.tokens_s(len(old))
        # prefix[i] = min(base[:i]), suffix[i] = min(base[i:]), both +inf when empty.
        prefix = np.concatenate(([np.inf], np.minimum.accumulate(base)))
        suffix = np.concatenate((np.minimum.accumulate(base[::-1])[::-1], [np.inf]))
        at_level = np.concatenate(([0], np.cumsum(base <= level + 1e-9)))
        for k in range(1, cluster.layer_cap(node) + 1):
            t = node.tokens_s(k)
            inside = sliding_window_view(base, k).min(axis=1) + t  # per start s
            starts = np.arange(num_layers - k + 1)
            low = np.round(np.minimum(inside, np.minimum(prefix[starts], suffix[starts + k])), 6)
            lifted = np.concatenate(([0], np.cumsum(base + t <= level + 1e-9)))
            count = (
                at_level[-1]
                - (at_level[starts + k] - at_level[starts])
                + (lifted[starts + k] - lifted[starts])
            )
            s = int(np.lexsort((count, -low))[0])  # highest minimum, then fewest layers at the old level
            trial = base.copy()
            trial[s : s + k] += t
            key = _key(trial)
            if key >= now and LayerRange(s, s + k) != old:  # level moves too: a second may then lift
                found.append((key, node_id, LayerRange(s, s + k)))
    found.sort(key=lambda f: (f[0], str(f[1]), f[2].start, f[2].end), reverse=True)
    return found[:top]


def greedy_moves(
    cluster: Cluster, placement: Placement, movable: list[NodeID], max_moves: int, beam: int = 6
) -> Placement:
    """Up to max_moves moves (a node moves at most once), by a beam search over sequences of single moves.

    A beam rather than one greedy path: after a leave, the move that lifts the bottleneck often opens a hole
    that only a second move fills (seen on helix24: one move alone gained nothing after the first epoch).
    """
    states: list[tuple[tuple[float, int], Placement]] = [
        (_key(layer_throughput(cluster, placement)), placement)
    ]
    best = states[0]
    for _ in range(max_moves):
        nxt: dict[tuple[tuple[NodeID, LayerRange], ...], tuple[tuple[float, int], Placement]] = {}
        for _, state in states:
            left = [n for n in movable if state.get(n) == placement.get(n)]
            for key, node_id, new in best_moves(cluster, state, left, beam):
                moved = {**state, node_id: new}
                sig = tuple(sorted((n, r) for n, r in moved.items() if placement.get(n) != r))
                nxt[sig] = (key, moved)
        states = sorted(nxt.values(), key=lambda t: t[0], reverse=True)[:beam]
        if not states:
            break
        best = max(best, states[0], key=lambda t: t[0])
    return dict(best[1])


def add_spares(
    cluster: Cluster,
    placement: Placement,
    spare_replicas: int,
    held: Placement | None = None,
    budget: int | None = None,
) -> Placement:
    """Grow ranges toward the least-replicated layers while the max flow does not drop.

    Idle nodes take a least-replicated run; busy nodes with free max_layers extend over one next to them.
    Stops when every layer has 1 + spare_replicas holders, or nothing fits without lowering the flow. A node
    of `held` that changes counts against `budget` (None: no limit).
    """
    target = 1 + spare_replicas
    base = flow_of(cluster, placement)
    out = dict(placement)
    for _ in range(cluster.model.num_layers * max(spare_replicas, 1)):
        grown = _grow_once(cluster, out, target, base, held, budget)
        if grown is None:
            break
        out = grown
    # A node still idle (a joiner) takes the weakest layers it fits, as Parallax's joiners do: it drops no
    # sessions, so it needs no budget, only not to lower the flow.
    for n in cluster.nodes:
        if n.id not in out and cluster.layer_cap(n) > 0:
            for _, node_id, r in best_moves(cluster, out, [n.id], top=1):
                if flow_of(cluster, {**out, node_id: r}) >= base * (1.0 - FLOW_TOL):
                    out[node_id] = r
    return out


def _runs_below(counts: list[int], target: int) -> list[tuple[int, int]]:
    """Maximal runs of layers held fewer than `target` times, least replicated first."""
    runs: list[tuple[int, int, int]] = []
    for layer, c in enumerate(counts):
        if c >= target:
            continue
        if runs and runs[-1][1] == layer and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], layer + 1, c)
        else:
            runs.append((layer, layer + 1, c))
    return [(a, b) for a, b, _ in sorted(runs, key=lambda r: (r[2], r[0]))]


def _grow_once(
    cluster: Cluster,
    placement: Placement,
    target: int,
    base: float,
    held: Placement | None,
    budget: int | None,
) -> Placement | None:
    counts = coverage(placement.values(), cluster.model.num_layers)
    moved = len(moved_nodes(held, placement)) if held else 0
    for p, q in _runs_below(counts, target):
        options: list[Placement] = []
        for n in cluster.nodes:
            k, r = cluster.layer_cap(n), placement.get(n.id)
            if k == 0 or (r is not None and len(r) >= k):
                continue
            if held and n.id in held and placement.get(n.id) == held[n.id] and budget is not None:
                if moved >= budget:
                    continue  # growing it would be one more move than allowed
            if r is None:
                new = LayerRange(p, min(q, p + k))
            elif p <= r.end < q:
                new = LayerRange(r.start, min(q, r.start + k))
            elif p < r.start <= q:
                new = LayerRange(max(p, r.end - k), r.end)
            else:
                continue
            options.append({**placement, n.id: new})
        for option in shortlist(cluster, options):
            if flow_of(cluster, option) >= base * (1.0 - FLOW_TOL):
                return option
    return None
