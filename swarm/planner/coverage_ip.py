"""The coverage integer program: max-min layer coverage over node *kinds*, solved with HiGHS.

Where links do not bind, the max flow of a placement equals its coverage score (graph.coverage_score), so
placement becomes: choose for each kind g (nodes with the same cap and throughput table) how many of its
n_g nodes hold each interval [s, s + k):

    max F   s.t.   sum_{g, s <= l < s + k} t_g(k) x_gsk >= F   for every layer l,
                   sum_{s, k} x_gsk <= n_g,   x_gsk in {0, 1, ..., n_g}.

Counting nodes per kind instead of naming them removes the symmetry between identical GPUs that cripples the
per-node Helix MILP (milp.py): on the 24-node Helix cluster it lifts an annealed placement from 93% to 98.5%
of the compute bound in 20 s. It weakens quickly with more kinds: on 42 nodes of 7 kinds it does not
improve a good start in 30 s, and re-solving 3 kinds at a time with the rest fixed (tried) gained nothing
either, as HiGHS spends the time in root cut rounds; solve.py uses it only up to MAX_KINDS kinds.
Nodes whose tables differ slightly (same GPU model, jittered measurements) are pooled under the
element-wise minimum table, which can only understate what a placement achieves; the caller re-scores
every result with the real max flow. HiGHS's dual bound bounds the max flow of ANY placement only when
every pool is exact (tables equal), since coverage bounds flow from above.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import highspy
import numpy as np

from swarm.planner.cluster import Cluster, ClusterNode
from swarm.planner.graph import upper_bound
from swarm.planner.placement import Placement
from swarm.types import LayerRange, NodeID

logger = logging.getLogger(__name__)


Kind = tuple[int, tuple[float, ...], list[ClusterNode]]  # (cap, pooled table, members)
MAX_KINDS = 4  # beyond this many node kinds the IP does not pay for its time (measured, see above)


@dataclass(frozen=True)
class CoverageResult:
    placement: Placement | None  # None when HiGHS found nothing (no warm start and no time)
    dual_bound_tokens_s: float  # bounds the max flow of any placement when bound_valid
    bound_valid: bool


def node_kinds(cluster: Cluster, pool: bool = True) -> list[Kind]:
    """(cap, table, members) per kind: nodes with the same cap and GPU model under their minimum table
    (pool=True), or only nodes with identical tables (pool=False: exact, one kind per node if all differ)."""
    pools: dict[tuple[int, str], list[ClusterNode]] = {}
    for n in cluster.nodes:
        cap = cluster.layer_cap(n)
        if cap == 0:
            continue
        exact_label = str(n.tokens_s_by_layers[:cap])
        label = str(n.extra.get("gpu", exact_label)) if pool else exact_label
        pools.setdefault((cap, label), []).append(n)
    kinds = []
    for (cap, _), members in pools.items():
        table = tuple(min(m.tokens_s_by_layers[k] for m in members) for k in range(cap))
        kinds.append((cap, table, members))
    return kinds


def solve_coverage_ip(
    cluster: Cluster,
    time_limit_s: float,
    warm_start: Placement | None = None,
    current: Placement | None = None,
    seed: int = 0,
    pool: bool = True,
) -> CoverageResult:
    """Best coverage placement HiGHS finds in the time limit, warm-started from `warm_start` if given.

    pool=False keeps nodes with different tables apart: a bigger program, but its bound is always valid."""
    kinds = node_kinds(cluster, pool)
    exact = all(all(m.tokens_s_by_layers[:cap] == table for m in members) for cap, table, members in kinds)
    offset = np.zeros(cluster.model.num_layers)
    placement, bound = _solve(cluster, kinds, offset, time_limit_s, warm_start, current, seed)
    return CoverageResult(placement, bound, exact and np.isfinite(bound))


def _solve(
    cluster: Cluster,
    kinds: list[Kind],
    offset: np.ndarray,
    time_limit_s: float,
    warm_start: Placement | None,
    current: Placement | None,
    seed: int,
) -> tuple[Placement | None, float]:
    """max F s.t. offset_l + sum t x >= F per layer, over `kinds` only. Returns (placement of those kinds'
    nodes, HiGHS's dual bound)."""
    started = time.perf_counter()
    num_layers = cluster.model.num_layers
    cols: list[tuple[int, int, int]] = []  # (kind, start, count)
    for g, (cap, _, _) in enumerate(kinds):
        for k in range(1, cap + 1):
            cols.extend((g, s, k) for s in range(num_layers - k + 1))
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", int(seed))
    h.setOptionValue("mip_rel_gap", 1e-3)
    h.setOptionValue("presolve", "off")  # measured: presolve alone took 4.7 s of an 8 s run on 42 nodes
    # Rows: one per layer (F - covered <= offset), then one per kind (nodes used <= n_g).
    inf = highspy.kHighsInf
    lower = np.full(num_layers + len(kinds), -inf)
    upper = np.concatenate([offset, [float(len(m)) for _, _, m in kinds]])
    h.addRows(
        len(lower), lower, upper, 0, np.zeros(len(lower), dtype=np.int32), np.zeros(0, np.int32), np.zeros(0)
    )
    # Columns, built column-wise: F first, then every (kind, start, count).
    starts, index, value = [0], list(range(num_layers)), [1.0] * num_layers
    for g, s, k in cols:
        starts.append(len(index))
        index.extend(range(s, s + k))
        value.extend([-kinds[g][1][k - 1]] * k)
        index.append(num_layers + g)
        value.append(1.0)
    n = len(cols) + 1
    cost = np.zeros(n)
    cost[0] = 1.0
    col_upper = np.array([upper_bound(cluster)] + [float(len(kinds[g][2])) for g, _, _ in cols])
    h.addCols(
        n,
        cost,
        np.zeros(n),
        col_upper,
        len(index),
        np.array(starts, dtype=np.int32),
        np.array(index, dtype=np.int32),
        np.array(value, dtype=np.float64),
    )
    h.changeColsIntegrality(n - 1, np.arange(1, n, dtype=np.int32), np.ones(n - 1, dtype=np.uint8))
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    if warm_start is not None:
        h.setSolution(n, np.arange(n, dtype=np.int32), _warm_values(kinds, cols, warm_start, offset))
    # The limit covers building the model too.
    h.setOptionValue("time_limit", max(time_limit_s - (time.perf_counter() - started), 0.05))
    h.run()
    info = h.getInfo()
    placement = None
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        x = list(h.getSolution().col_value)
        placement = _assign(kinds, cols, x, current)
    logger.debug(
        "coverage ip: %s, %.1f tokens/s, bound %.1f, %d kinds, %d columns",
        h.modelStatusToString(h.getModelStatus()),
        info.objective_function_value if placement is not None else 0.0,
        info.mip_dual_bound,
        len(kinds),
        n,
    )
    return placement, float(info.mip_dual_bound)


def _warm_values(
    kinds: list[Kind], cols: list[tuple[int, int, int]], placement: Placement, offset: np.ndarray
) -> np.ndarray:
    """x counts of the warm placement, F its coverage under the pooled tables."""
    kind_of = {m.id: g for g, (_, _, members) in enumerate(kinds) for m in members}
    col_of = {c: j for j, c in enumerate(cols, 1)}
    values = np.zeros(len(cols) + 1)
    pooled: Placement = {}
    for node_id, r in placement.items():
        g = kind_of.get(node_id)
        if g is None or len(r) > kinds[g][0]:
            continue
        values[col_of[(g, r.start, len(r))]] += 1.0
        pooled[node_id] = r
    coverage = offset.copy()
    for node_id, r in pooled.items():
        coverage[r.start : r.end] += kinds[kind_of[node_id]][1][len(r) - 1]
    values[0] = max(float(coverage.min()), 0.0) if len(coverage) else 0.0
    return values


def _assign(
    kinds: list[Kind],
    cols: list[tuple[int, int, int]],
    x: list[float],
    current: Placement | None,
) -> Placement:
    """Hand each kind's chosen intervals to its nodes, fastest nodes to longest ranges, and a node to the
    interval it already holds (or overlaps most) when re-planning, so fewer layers must be reloaded."""
    wanted: dict[int, list[LayerRange]] = {}
    for j, (g, s, k) in enumerate(cols, 1):
        for _ in range(int(round(x[j]))):
            wanted.setdefault(g, []).append(LayerRange(s, s + k))
    placement: Placement = {}
    for g, ranges in wanted.items():
        free: list[NodeID] = [m.id for m in sorted(kinds[g][2], key=lambda m: -sum(m.tokens_s_by_layers))]
        for r in sorted(ranges, key=lambda r: -len(r)):
            if not free:
                break

            def overlap(node_id: NodeID, r: LayerRange = r) -> int:
                old = (current or {}).get(node_id)
                both = old.intersect(r) if old is not None else None
                return len(both) if both is not None else 0

            chosen = max(free, key=lambda i: (overlap(i), -free.index(i)))
            free.remove(chosen)
            placement[chosen] = r
    return placement
