"""Prefill and decode as two flows over one placement (Splitwise in a swarm): the linear program.

A request is a prompt (prefill: compute-bound) and its generated tokens (decode: memory-bound). Today one
flow serves both: a session prefills and decodes on the same route. Here the two phases are two commodities
over the SAME placement, each a flow from the source to the sink through valid edges:

    P_e >= 0  prompt tokens/s on edge e        D_e >= 0  decode tokens/s on edge e

and per node i holding k layers, with p_i(k) its prompt tokens/s and d_i(k) its decode tokens/s (both running
all k layers per token), and n_i(k) the sessions its KV cache holds:

    P_in(i) / p_i(k) + D_in(i) / d_i(k) <= 1     the node's time, shared by the two phases
    D_in(i) <= n_i(k) * session_tokens_s          a decoding session keeps its KV there for its whole life
    P_e + D_e <= link tokens/s                    both carry one hidden state per token
    sum_source P = m * sum_source D               the workload mix: m prompt tokens per generated token

Objective: max sum_source D, i.e. requests/s = D / mean output tokens, such that both flows suffice. The
single-route baseline is the same LP with P_e = m D_e on every edge (one route serves both phases). A split
session holds KV on its prefill route only while it prefills and hands it over (not charged here: the
simulator models the hand-over's time on the links).

Where splitting does not pay (the split LP serves fewer than 1 + min_gain times the requests of the
single-route LP on today's placement; always so when every node has the same prefill-to-decode ratio and
memory does not bind), the plan is today's, unchanged: no decode_flows. Otherwise the plan's `flows` carry
prompt tokens/s and its `decode_flows` decode tokens/s (swarm.types.Plan).

swarm.planner.split chooses the placement and decides whether splitting pays; swarm.planner.split_milp
places layers for the two phases.

The plan's max_flow_tokens_s stays the placement's max flow of one kind (what every plan carries, so the live
planner compares plans as before); Plan.extra holds the split's decode tokens/s, requests/s and gain.

Per-node figures come from ClusterNode.extra: "prefill_tokens_s_by_layers" (required for a split: a node
without one makes the plan today's) and "kv_tokens_by_layers" (tokens of KV the node fits per held layer
when it holds k layers; absent: memory does not bind). d_i(k) is the node's tokens_s_by_layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np

from swarm.planner.cluster import Cluster, ClusterNode
from swarm.planner.graph import valid_edges
from swarm.planner.milp import _Model
from swarm.planner.placement import Placement
from swarm.types import SINK, SOURCE, EdgeFlow, NodeID

PREFILL_KEY = "prefill_tokens_s_by_layers"
KV_KEY = "kv_tokens_by_layers"
_EPS = 1e-6


@dataclass(frozen=True)
class SplitConfig:
    """The workload and the threshold a split plan must clear."""

    # The Azure LLM conversation trace (2023): about 763 prompt and 232 output tokens a request (swarm/sim/trace.py).
    prompt_tokens_per_output: float = 763.0 / 232.0
    mean_output_tokens: float = 232.0
    session_tokens: float = 763.0 + 232.0  # KV tokens one decoding session holds (its prompt and output)
    session_tokens_s: float = 8.0  # decode tokens/s one session gets (1 / time between its tokens)
    min_gain: float = 0.1  # a split plan must serve this much more requests/s than single routes
    milp_time_limit_s: float = 0.0  # the two-phase placement MILP's time (split_milp.py; 0: candidates only)

    def __post_init__(self) -> None:
        for name in ("prompt_tokens_per_output", "mean_output_tokens", "session_tokens", "session_tokens_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_gain < 0 or self.milp_time_limit_s < 0:
            raise ValueError("min_gain and milp_time_limit_s must be >= 0")


@dataclass(frozen=True)
class PhaseFlows:
    """One LP's answer on one placement: decode tokens/s served and the flows of each phase."""

    decode_tokens_s: float
    prefill: tuple[EdgeFlow, ...]
    decode: tuple[EdgeFlow, ...]

    def requests_s(self, config: SplitConfig) -> float:
        return self.decode_tokens_s / config.mean_output_tokens


def can_split(cluster: Cluster) -> bool:
    """Every node that can hold a layer announces its prefill speed."""
    return all(PREFILL_KEY in n.extra for n in cluster.nodes if cluster.layer_cap(n) > 0)


def _table(node: ClusterNode, key: str, k: int) -> float | None:
    values = node.extra.get(key)
    if values is None:
        return None
    if len(values) < k:
        raise ValueError(f"node {node.id}: {key} has {len(values)} entries, needs {k}")
    return float(values[k - 1])


def phase_flows(cluster: Cluster, placement: Placement, config: SplitConfig, split: bool) -> PhaseFlows:
    """The LP of the module docstring on `placement`: two independent flows (split) or one route for both."""
    m_ratio = config.prompt_tokens_per_output
    edges = valid_edges(cluster, placement)
    model = _Model()
    # Per edge the prefill and decode columns; single routes tie prefill to m x decode on every edge.
    cols: list[tuple[int, int]] = []
    for u, _, cap in edges:
        cost = 1.0 if u == SOURCE else 0.0
        if split:
            p, d = model.var(0.0, cap), model.var(0.0, cap, cost)
            model.row(-highspy.kHighsInf, cap, {p: 1.0, d: 1.0})
        else:
            d = model.var(0.0, cap / (1.0 + m_ratio), cost)
            p = d  # P_e = m D_e: the prefill column is the decode column, weighted by m below
        cols.append((p, d))
    p_weight = 1.0 if split else m_ratio
    for node_id, layers in placement.items():
        node, k = cluster.node_by_id[node_id], len(layers)
        ins = [c for (_, v, _), c in zip(edges, cols, strict=True) if v == node_id]
        outs = [c for (u, _, _), c in zip(edges, cols, strict=True) if u == node_id]
        for part in (0, 1) if split else (1,):
            terms: dict[int, float] = {}
            for c in ins:
                terms[c[part]] = terms.get(c[part], 0.0) + 1.0
            for c in outs:
                terms[c[part]] = terms.get(c[part], 0.0) - 1.0
            model.row(0.0, 0.0, terms)
        _node_rows(model, node, k, ins, p_weight, config)
    source = [c for (u, _, _), c in zip(edges, cols, strict=True) if u == SOURCE]
    if split:
        terms = {p: 1.0 for p, _ in source}
        for _, d in source:
            terms[d] = terms.get(d, 0.0) - m_ratio
        model.row(0.0, 0.0, terms)
    values = _solve_lp(model)
    flows = _read_flows(edges, cols, values, split, m_ratio)
    if not split:
        return flows
    # The LP's optimum is often a corner where one of two interchangeable peers takes every prompt and the
    # other none; the average over swapping them serves as much and shares the load.
    groups = _interchangeable(cluster, placement)
    return PhaseFlows(
        flows.decode_tokens_s, _averaged(flows.prefill, groups), _averaged(flows.decode, groups)
    )


def _node_rows(
    model: _Model, node: ClusterNode, k: int, ins: list[tuple[int, int]], p_weight: float, config: SplitConfig
) -> None:
    """The node's time shared by the two phases, and its KV cache bounding the decode flow through it."""
    prefill_s = _table(node, PREFILL_KEY, k)
    decode_s = node.tokens_s(k)
    time_terms: dict[int, float] = {}
    idle: dict[int, float] = {}  # a phase the node cannot run at all carries no flow
    for p, d in ins:
        for col, speed, weight in ((p, prefill_s, p_weight), (d, decode_s, 1.0)):
            if speed is not None and speed > 0:
                time_terms[col] = time_terms.get(col, 0.0) + weight / speed
            else:
                idle[col] = 1.0
    model.row(-highspy.kHighsInf, 1.0, time_terms)
    if idle:
        model.row(-highspy.kHighsInf, 0.0, idle)
    kv_tokens = _table(node, KV_KEY, k)
    if kv_tokens is not None:
        sessions = kv_tokens / config.session_tokens
        model.row(-highspy.kHighsInf, sessions * config.session_tokens_s, {d: 1.0 for _, d in ins})


def _solve_lp(model: _Model) -> list[float]:
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    model.load(h)
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return [0.0] * len(model.cost)  # cannot happen (zero flow is feasible), but never crash the planner
    return [float(v) for v in np.asarray(h.getSolution().col_value, dtype=float)]


def _interchangeable(cluster: Cluster, placement: Placement) -> dict[NodeID, tuple[NodeID, ...]]:
    """Each placed node's group of interchangeable nodes (the same range, tables and links to everyone)."""
    bandwidth = cluster.bandwidth_bytes_s
    ends = [SOURCE, SINK, *cluster.node_by_id]

    def signature(i: NodeID) -> tuple[object, ...]:
        n = cluster.node_by_id[i]
        tables = (tuple(n.extra.get(PREFILL_KEY, ())), tuple(n.extra.get(KV_KEY, ())))
        return (placement[i], n.max_layers, n.tokens_s_by_layers, *tables)

    def same_links(a: NodeID, b: NodeID) -> bool:
        if bandwidth(a, b) != bandwidth(b, a):
            return False
        return all(
            bandwidth(a, o) == bandwidth(b, o) and bandwidth(o, a) == bandwidth(o, b)
            for o in ends
            if o not in (a, b)
        )

    groups: list[list[NodeID]] = []
    by_signature: dict[tuple[object, ...], list[list[NodeID]]] = {}
    for i in sorted(placement):
        candidates = by_signature.setdefault(signature(i), [])
        home = next((g for g in candidates if same_links(g[0], i)), None)
        if home is None:
            home = []
            candidates.append(home)
            groups.append(home)
        home.append(i)
    return {i: tuple(g) for g in groups for i in g}


def _averaged(flows: tuple[EdgeFlow, ...], groups: dict[NodeID, tuple[NodeID, ...]]) -> tuple[EdgeFlow, ...]:
    """The flows averaged over every permutation within each group of interchangeable nodes: each edge between
    two groups (or a group and the client) carries the mean of all such edges. No edge joins two members of
    one group (they hold the same range)."""
    orbit: dict[tuple[tuple[NodeID, ...], tuple[NodeID, ...]], float] = {}
    for f in flows:
        key = (groups.get(f.src, (f.src,)), groups.get(f.dst, (f.dst,)))
        orbit[key] = orbit.get(key, 0.0) + f.tokens_s
    out: list[EdgeFlow] = []
    for (srcs, dsts), total in orbit.items():
        share = total / (len(srcs) * len(dsts))
        out.extend(EdgeFlow(a, b, share) for a in srcs for b in dsts if share > _EPS)
    return tuple(sorted(out, key=lambda f: (f.src != SOURCE, f.src, f.dst)))


def _read_flows(
    edges: list[tuple[NodeID, NodeID, float]],
    cols: list[tuple[int, int]],
    values: list[float],
    split: bool,
    m_ratio: float,
) -> PhaseFlows:
    prefill: list[EdgeFlow] = []
    decode: list[EdgeFlow] = []
    for (u, v, _), (p, d) in zip(edges, cols, strict=True):
        d_value = values[d]
        p_value = values[p] if split else m_ratio * d_value
        if p_value > _EPS:
            prefill.append(EdgeFlow(u, v, p_value))
        if d_value > _EPS:
            decode.append(EdgeFlow(u, v, d_value))
    order = lambda f: (f.src != SOURCE, f.src, f.dst)  # noqa: E731 - graph.max_flow's order
    total = sum(f.tokens_s for f in decode if f.src == SOURCE)
    return PhaseFlows(total, tuple(sorted(prefill, key=order)), tuple(sorted(decode, key=order)))
