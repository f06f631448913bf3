"""The Helix placement MILP, solved with HiGHS (highspy).

Variables, for each usable node i (cap_i = most layers it fits, L = model layers):
    s_i in {0..L-1}        first layer                      (integer)
    b_ik in {0,1}, k=1..cap_i   node holds exactly k layers (sum_k b_ik <= 1; none = idle)
        so end e_i = s_i + sum_k k b_ik and throughput sum_k t_i(k) b_ik are linear
    f_i >= 0               tokens/s through the node
and for each kept edge e = (u, v) (source -> i, i -> sink, i -> j):
    x_e >= 0               tokens/s on the edge,  y_e in {0,1}  the placement makes the edge valid.
Constraints:
    e_i <= L;  f_i <= sum_k t_i(k) b_ik;  inflow_i = f_i = outflow_i;  x_e <= M_e y_e
    source -> i valid:  s_i <= (L-1)(1 - y)          (i starts at layer 0)
    i -> sink valid:    e_i >= L y                    (i ends at the last layer)
    u -> v valid:       s_v <= e_u + (L-1)(1 - y)  and  e_u + 1 <= e_v + (L+1)(1 - y)
    M_e = min(link tokens/s, max throughput of either end)   (tight big-M)
    compute cut:  L * F <= sum_i sum_k k t_i(k) b_ik  (valid: see graph.upper_bound), and F <= target bound.
Objective: max F = sum_i x_(source,i)  -  reload_cost * sum_i (layers of i not held in the current placement),
linearised with an overlap ov_i <= e_i - a_i, c_i - s_i, len_i (when a binary z_i says the new and current
range [a_i, c_i) meet; ov_i = 0 otherwise).

Moves (local branching, Fischetti & Lodi), when `current` is given and max_moves or move_cost_tokens_s is set:
a binary keep_i per node that holds a range now; keep_i = 1 pins s_i and the length to the current range;
sum_i (1 - keep_i) <= max_moves, and the objective gains move_cost * keep_i (a price on every node whose range
changes, not only per layer loaded). Nodes idle now are free to take layers (they drop no sessions).

Known weakness (measured): on 24 nodes / 80 layers HiGHS finds no positive flow in 300 s from scratch, so
the caller warm-starts it with the best search result. Identical nodes are ordered (s_i <= s_j) to break
symmetry, slow links are pruned to the k best per node, and HiGHS stops at mip_rel_gap of its bound.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import highspy
import numpy as np

from swarm.planner.cluster import Cluster, ClusterLink, ClusterNode
from swarm.planner.graph import max_flow
from swarm.planner.placement import Placement
from swarm.types import SINK, SOURCE, LayerRange, NodeID

logger = logging.getLogger(__name__)

# The planner's wall-clock limit per solve, building the model included: the one default every caller shares
# (solve(), the live planner's ReplanConfig and PlannerConfig, the simulator, `python -m swarm.planner`).
TIME_LIMIT_S = 20.0


@dataclass(frozen=True)
class MilpConfig:
    time_limit_s: float = TIME_LIMIT_S  # wall-clock limit, building the model included
    prune_k: int = 8  # hop links kept per node (ties with the k-th best kept too); 0 keeps all
    reload_cost_tokens_s: float = 0.0  # objective penalty per layer a node loads anew
    mip_rel_gap: float = 0.01  # stop within this fraction of the proven bound
    seed: int = 0
    threads: int = 1
    max_moves: int | None = None  # most nodes holding a range now that may change it (None: no cap)
    move_cost_tokens_s: float = 0.0  # objective penalty per node holding a range now whose range changes
    node_limit: int | None = None  # branch-and-bound nodes (a deterministic stop, for tests)


@dataclass(frozen=True)
class MilpResult:
    placement: Placement | None  # None when HiGHS found no solution
    objective: float
    dual_bound_tokens_s: float  # HiGHS's bound on the MILP objective
    dual_bound_valid: bool  # true when that bound also bounds the real problem (no pruning, no reload term)
    status: str


def prune_links(cluster: Cluster, k: int, keep: set[tuple[NodeID, NodeID]] = frozenset()) -> Cluster:  # type: ignore[assignment]
    """Keep source/sink links, the k fastest outgoing hop links of each node, and the links in `keep`."""
    if k <= 0:
        return cluster
    by_src: dict[NodeID, list[ClusterLink]] = {}
    kept: list[ClusterLink] = []
    for link in cluster.link_by_pair.values():
        if link.src == SOURCE or link.dst == SINK or (link.src, link.dst) in keep:
            kept.append(link)
        else:
            by_src.setdefault(link.src, []).append(link)
    order = {n.id: i for i, n in enumerate(cluster.nodes)}
    for links in by_src.values():
        links.sort(key=lambda lk: -lk.bandwidth_bytes_s)
        if len(links) > k:
            # Ties with the k-th best are kept (that keeps identical nodes interchangeable, so symmetry
            # breaking still applies) unless they would more than double the edges.
            threshold = links[k - 1].bandwidth_bytes_s
            tied = [lk for lk in links if lk.bandwidth_bytes_s >= threshold]
            if len(tied) <= 2 * k:
                links = tied
            else:
                # Too many ties: take the k next nodes in cluster order after this one (a circulant choice).
                n = len(order)
                links.sort(key=lambda lk: (-lk.bandwidth_bytes_s, (order[lk.dst] - order[lk.src]) % n))
                links = links[:k]
        kept.extend(links)
    return cluster.with_links(tuple(kept))


class _Model:
    """Column and row buffers for HiGHS, filled by name-free indices."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def var(self, lower: float, upper: float, cost: float = 0.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        if integer:
            self.integer.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def row(self, lower: float, upper: float, coefs: dict[int, float]) -> None:
        self.rows.append((lower, upper, coefs))

    def load(self, h: highspy.Highs) -> None:
        n = len(self.cost)
        zeros_i = np.zeros(0, dtype=np.int32)
        h.addCols(
            n,
            np.array(self.cost),
            np.array(self.lower),
            np.array(self.upper),
            0,
            np.zeros(n, dtype=np.int32),
            zeros_i,
            np.zeros(0),
        )
        if self.integer:
            idx = np.array(self.integer, dtype=np.int32)
            h.changeColsIntegrality(len(idx), idx, np.full(len(idx), 1, dtype=np.uint8))
        starts: list[int] = []
        index: list[int] = []
        value: list[float] = []
        for _, _, coefs in self.rows:
            starts.append(len(index))
            for col, c in coefs.items():
                index.append(col)
                value.append(c)
        h.addRows(
            len(self.rows),
            np.array([r[0] for r in self.rows]),
            np.array([r[1] for r in self.rows]),
            len(index),
            np.array(starts, dtype=np.int32),
            np.array(index, dtype=np.int32),
            np.array(value, dtype=np.float64),
        )


Edge = tuple[NodeID, NodeID, int, int]  # (src, dst, x column: tokens/s on it, y column: the edge is valid)


@dataclass
class _Helix:
    """The MILP's columns by meaning: per node its first layer s, length choice b and throughput f."""

    m: _Model
    nodes: list[ClusterNode]
    s: dict[NodeID, int]
    b: dict[NodeID, list[int]]
    f: dict[NodeID, int]
    peak: dict[NodeID, float]  # the node's best tokens/s at any length it fits
    edges: list[Edge] = field(default_factory=list)
    overlap_cols: dict[NodeID, tuple[int, int]] = field(default_factory=dict)  # (ov, z) per reloading node
    groups: list[list[NodeID]] = field(default_factory=list)  # identical nodes, ordered by start
    keep_cols: dict[NodeID, int] = field(default_factory=dict)  # keep binary per node holding a range now

    def end_terms(self, i: NodeID, sign: float) -> dict[int, float]:
        """sign * e_i, where e_i = s_i + sum_k k b_ik is the node's end layer."""
        terms = {self.s[i]: sign}
        for k, col in enumerate(self.b[i], start=1):
            terms[col] = sign * k
        return terms


def solve_milp(
    cluster: Cluster,
    config: MilpConfig,
    warm_start: Placement | None = None,
    current: Placement | None = None,
    target_tokens_s: float | None = None,
) -> MilpResult:
    """Solve the MILP within config.time_limit_s; the warm start (valid placement) seeds HiGHS's incumbent."""
    started = time.perf_counter()
    keep: set[tuple[NodeID, NodeID]] = set()
    if warm_start is not None:
        keep = {(f.src, f.dst) for f in max_flow(cluster, warm_start, least_delay=False).flows}
    pruned = prune_links(cluster, config.prune_k, keep)
    pruned_any = len(pruned.link_by_pair) < len(cluster.link_by_pair)
    reload = config.reload_cost_tokens_s if current else 0.0
    helix = _node_columns(cluster)
    _add_edges(helix, pruned)
    _add_node_rows(helix, current, reload, cluster.model.num_layers)
    moves = bool(current) and (config.max_moves is not None or config.move_cost_tokens_s > 0)
    if moves and current:
        _add_keep_rows(helix, cluster, current, config, warm_start)
    # Symmetry breaking would force identical nodes to swap ranges; with reload or keep terms they differ.
    _add_cut_and_symmetry(helix, pruned, target_tokens_s, reload or moves)
    h = _highs(config, helix.m)
    if warm_start is not None:
        warm = _sorted_within_groups(warm_start, helix.groups)
        values = _warm_values(pruned, warm, helix, current)
        h.setSolution(len(values), np.arange(len(values), dtype=np.int32), np.array(values))
    # The limit covers building the model too (seconds on large clusters).
    h.setOptionValue("time_limit", max(config.time_limit_s - (time.perf_counter() - started), 0.05))
    h.run()
    info = h.getInfo()
    status = h.modelStatusToString(h.getModelStatus())
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    placement = _read_placement(helix, list(h.getSolution().col_value)) if has_solution else None
    logger.info(
        "milp: %s, objective %.1f, bound %.1f, %d nodes explored",
        status,
        info.objective_function_value if has_solution else 0.0,
        info.mip_dual_bound,
        info.mip_node_count,
    )
    return MilpResult(
        placement=placement,
        objective=info.objective_function_value if has_solution else 0.0,
        dual_bound_tokens_s=float(info.mip_dual_bound),
        dual_bound_valid=not pruned_any and not reload and not moves and np.isfinite(info.mip_dual_bound),
        status=status,
    )


def _node_columns(cluster: Cluster) -> _Helix:
    """Columns s, b, f of every node that can hold a layer (in that order: column indices are the model)."""
    L = cluster.model.num_layers
    nodes = [n for n in cluster.nodes if cluster.layer_cap(n) > 0]
    m = _Model()
    s = {n.id: m.var(0, L - 1, integer=True) for n in nodes}
    b = {n.id: [m.var(0, 1, integer=True) for _ in range(cluster.layer_cap(n))] for n in nodes}
    peak = {n.id: max(n.tokens_s_by_layers[: cluster.layer_cap(n)]) for n in nodes}
    f = {n.id: m.var(0, peak[n.id]) for n in nodes}
    return _Helix(m, nodes, s, b, f, peak)


def _add_edges(helix: _Helix, pruned: Cluster) -> None:
    """Columns x, y and the validity rows of every kept link with a positive capacity (tight big-M)."""
    m, s, peak = helix.m, helix.s, helix.peak
    L = pruned.model.num_layers
    act, tok = pruned.model.activation_bytes_per_token, pruned.model.token_id_bytes
    for (u, v), link in pruned.link_by_pair.items():
        if u == SOURCE:
            big_m = min(link.bandwidth_bytes_s / tok, peak.get(v, 0.0))
        elif v == SINK:
            big_m = min(link.bandwidth_bytes_s / act, peak.get(u, 0.0))
        else:
            big_m = min(link.bandwidth_bytes_s / act, peak.get(u, 0.0), peak.get(v, 0.0))
        if big_m <= 0:
            continue
        x = m.var(0, big_m, cost=1.0 if u == SOURCE else 0.0)
        y = m.var(0, 1, integer=True)
        helix.edges.append((u, v, x, y))
        m.row(-highspy.kHighsInf, 0.0, {x: 1.0, y: -big_m})
        if u == SOURCE:
            m.row(-highspy.kHighsInf, L - 1, {s[v]: 1.0, y: L - 1})
        elif v == SINK:
            m.row(0.0, highspy.kHighsInf, {**helix.end_terms(u, 1.0), y: -float(L)})
        else:
            m.row(-highspy.kHighsInf, L - 1, {s[v]: 1.0, **helix.end_terms(u, -1.0), y: L - 1})
            terms = helix.end_terms(u, 1.0)
            for col, c in helix.end_terms(v, -1.0).items():
                terms[col] = terms.get(col, 0.0) + c
            terms[y] = L + 1
            m.row(-highspy.kHighsInf, L, terms)


def _add_node_rows(helix: _Helix, current: Placement | None, reload: float, L: int) -> None:
    """Per node: one length at most, end within the model, throughput, flow conservation, reload charge."""
    m, b, f = helix.m, helix.b, helix.f
    for n in helix.nodes:
        i = n.id
        m.row(-highspy.kHighsInf, 1.0, {col: 1.0 for col in b[i]})
        m.row(-highspy.kHighsInf, L, helix.end_terms(i, 1.0))
        m.row(-highspy.kHighsInf, 0.0, {f[i]: 1.0, **{col: -n.tokens_s(k) for k, col in enumerate(b[i], 1)}})
        inflow = {x: 1.0 for (_, v, x, _) in helix.edges if v == i}
        outflow = {x: 1.0 for (u, _, x, _) in helix.edges if u == i}
        m.row(0.0, 0.0, {**inflow, f[i]: -1.0})
        m.row(0.0, 0.0, {**outflow, f[i]: -1.0})
        if reload:
            cols = _add_reload(m, i, helix.s[i], b[i], current.get(i) if current else None, reload, L)
            if cols is not None:
                helix.overlap_cols[i] = cols


def _add_cut_and_symmetry(
    helix: _Helix, pruned: Cluster, target_tokens_s: float | None, reload: float | bool
) -> None:
    """The compute cut, the target bound on F, and start order among identical nodes (without reload)."""
    m, L = helix.m, pruned.model.num_layers
    work_terms: dict[int, float] = {}
    for n in helix.nodes:
        for k, col in enumerate(helix.b[n.id], 1):
            work_terms[col] = -k * n.tokens_s(k)
    source_x = {x: 1.0 for (u, _, x, _) in helix.edges if u == SOURCE}
    m.row(-highspy.kHighsInf, 0.0, {**{x: float(L) for x in source_x}, **work_terms})
    if target_tokens_s is not None and target_tokens_s > 0:
        m.row(-highspy.kHighsInf, target_tokens_s, source_x)
    helix.groups = _identical_groups(pruned, helix.nodes) if not reload else []
    for g in helix.groups:
        for a_id, b_id in zip(g, g[1:], strict=False):
            m.row(-highspy.kHighsInf, 0.0, {helix.s[a_id]: 1.0, helix.s[b_id]: -1.0})


def _highs(config: MilpConfig, m: _Model) -> highspy.Highs:
    """A quiet, seeded HiGHS holding the model, maximising."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", float(config.mip_rel_gap))
    h.setOptionValue("random_seed", int(config.seed))
    h.setOptionValue("threads", int(config.threads))
    if config.node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(config.node_limit))
    m.load(h)
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    return h


def _read_placement(helix: _Helix, solution: list[float]) -> Placement:
    placement: Placement = {}
    for n in helix.nodes:
        count = sum(k for k, c in enumerate(helix.b[n.id], 1) if solution[c] > 0.5)
        if count > 0:
            start = int(round(solution[helix.s[n.id]]))
            placement[n.id] = LayerRange(start, start + count)
    return placement


def _add_reload(
    m: _Model, i: NodeID, s_col: int, b_cols: list[int], old: LayerRange | None, reload: float, L: int
) -> tuple[int, int] | None:
    """Charge reload per layer held outside the current range: cost * (len - overlap).

    overlap = max(0, min(e, c) - max(s, a)) for the current range [a, c); a binary z chooses between the
    "ranges meet" branch (overlap <= e - a and <= c - s) and overlap = 0. Returns the (ov, z) columns.
    """
    for k, col in enumerate(b_cols, 1):
        m.cost[col] -= reload * k
    if old is None:
        return None
    ov = m.var(0.0, float(len(old)), cost=reload)
    z = m.var(0, 1, integer=True)
    a, c = old.start, old.end
    length = {col: float(k) for k, col in enumerate(b_cols, 1)}
    # ov <= e - a + L(1 - z)
    m.row(
        -highspy.kHighsInf,
        L - a,
        {ov: 1.0, s_col: -1.0, **{col: -v for col, v in length.items()}, z: float(L)},
    )
    # ov <= c - s + L(1 - z)
    m.row(-highspy.kHighsInf, c + L, {ov: 1.0, s_col: 1.0, z: float(L)})
    m.row(-highspy.kHighsInf, 0.0, {ov: 1.0, z: -float(len(old))})  # ov <= len(old) z
    m.row(-highspy.kHighsInf, 0.0, {ov: 1.0, **{col: -v for col, v in length.items()}})  # ov <= len
    return ov, z


def _add_keep_rows(
    helix: _Helix, cluster: Cluster, current: Placement, config: MilpConfig, warm: Placement | None
) -> None:
    """keep_i = 1 pins node i to its current range [a, c); at most max_moves nodes have keep_i = 0."""
    m, L = helix.m, cluster.model.num_layers
    for n in helix.nodes:
        old = current.get(n.id)
        if old is None:
            continue  # idle now: taking layers drops no sessions, so it is neither capped nor priced
        fits = len(old) <= cluster.layer_cap(n) and old.end <= L
        keep = m.var(0, 1.0 if fits else 0.0, cost=config.move_cost_tokens_s, integer=True)
        helix.keep_cols[n.id] = keep
        if not fits:
            continue
        a = float(old.start)
        m.row(-highspy.kHighsInf, a + L, {helix.s[n.id]: 1.0, keep: float(L)})  # s <= a when kept
        m.row(-highspy.kHighsInf, 0.0, {helix.s[n.id]: -1.0, keep: a})  # s >= a when kept
        m.row(-highspy.kHighsInf, 0.0, {keep: 1.0, helix.b[n.id][len(old) - 1]: -1.0})  # same length
    if config.max_moves is not None and helix.keep_cols:
        # The warm start may itself move more (a repair before the solve): the cap never rejects it.
        warm_moves = sum(1 for i in helix.keep_cols if warm is not None and warm.get(i) != current.get(i))
        cap = max(config.max_moves, warm_moves)
        m.row(len(helix.keep_cols) - cap, highspy.kHighsInf, {k: 1.0 for k in helix.keep_cols.values()})


def _identical_groups(cluster: Cluster, nodes: list[ClusterNode]) -> list[list[NodeID]]:
    """Groups (2+) of interchangeable nodes: same throughput table, cap, and links to everyone else."""
    ids = [n.id for n in nodes]
    links = cluster.link_by_pair

    def bw(a: NodeID, b: NodeID) -> float:
        lk = links.get((a, b))
        return lk.bandwidth_bytes_s if lk else 0.0

    def same(a: NodeID, b: NodeID) -> bool:
        na, nb = cluster.node_by_id[a], cluster.node_by_id[b]
        if (na.max_layers, na.tokens_s_by_layers) != (nb.max_layers, nb.tokens_s_by_layers):
            return False
        if bw(a, b) != bw(b, a):
            return False
        return all(
            bw(a, o) == bw(b, o) and bw(o, a) == bw(o, b) for o in [SOURCE, SINK, *ids] if o not in (a, b)
        )

    groups: list[list[NodeID]] = []
    for i in ids:
        for g in groups:
            if same(g[0], i):
                g.append(i)
                break
        else:
            groups.append([i])
    return [g for g in groups if len(g) > 1]


def _sorted_within_groups(placement: Placement, groups: list[list[NodeID]]) -> Placement:
    """Permute ranges among identical nodes so starts ascend (idle counts as start 0), as symmetry demands."""
    out = dict(placement)
    for g in groups:
        ranges = sorted(
            (placement.get(i) for i in g), key=lambda r: (-1, 0) if r is None else (r.start, r.end)
        )
        for i, r in zip(g, ranges, strict=True):
            if r is None:
                out.pop(i, None)
            else:
                out[i] = r
    return out


def _warm_values(
    cluster: Cluster, placement: Placement, helix: _Helix, current: Placement | None
) -> list[float]:
    """A full feasible column vector for `placement`, with its max flow on the (pruned) cluster."""
    m, s, b, f, edges = helix.m, helix.s, helix.b, helix.f, helix.edges
    values = [0.0] * len(m.cost)
    plan = max_flow(cluster, placement, least_delay=False)
    flow_on = {(e.src, e.dst): e.tokens_s for e in plan.flows}
    for i, r in placement.items():
        if i not in s:
            continue
        values[s[i]] = float(r.start)
        values[b[i][len(r) - 1]] = 1.0
    for u, v, x, y in edges:
        amount = flow_on.get((u, v), 0.0)
        values[x] = min(amount, m.upper[x])
        ru = placement.get(u) if u != SOURCE else None
        rv = placement.get(v) if v != SINK else None
        values[y] = 1.0 if edge_valid(u, v, ru, rv, cluster.model.num_layers) else 0.0
    for i, col in f.items():
        values[col] = sum(values[x] for (_, v, x, _) in edges if v == i)
    for i, keep in helix.keep_cols.items():
        values[keep] = 1.0 if placement.get(i) == (current or {}).get(i) else 0.0
    for i, (ov, z) in helix.overlap_cols.items():
        old, new = (current or {}).get(i), placement.get(i)
        both = old.intersect(new) if old is not None and new is not None else None
        values[ov] = float(len(both)) if both is not None else 0.0
        values[z] = 1.0 if both is not None else 0.0
    return values


def edge_valid(u: NodeID, v: NodeID, ru: LayerRange | None, rv: LayerRange | None, num_layers: int) -> bool:
    """Whether edge u -> v may carry flow when u holds ``ru`` and v ``rv``: the source feeds a holder of layer 0,
    a holder of the last layer feeds the sink, and v goes on where u's layers end."""
    if u == SOURCE:
        return rv is not None and rv.start == 0
    if v == SINK:
        return ru is not None and ru.end == num_layers
    return ru is not None and rv is not None and rv.start <= ru.end < rv.end
