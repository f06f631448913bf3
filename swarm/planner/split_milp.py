"""The Helix placement MILP (milp.py) with prefill and decode as two commodities: a placement for split phases.

Columns and rows as in milp.py for the placement (s_i, b_ik, the edges' validity y_e and its rows), the decode
flow x_e (milp.py's flow column) and, new here, per edge the prefill flow xp_e, and per node and length k the
phases' shares P_ik, D_ik of the node's flow:

    xp_e <= M'_e y_e,   x_e + xp_e <= link tokens/s                 (both phases cross the link)
    sum_in xp = sum_k P_ik = sum_out xp,   sum_in x = sum_k D_ik = sum_out x      (conservation per phase)
    P_ik / p_i(k) + D_ik / d_i(k) <= b_ik                            (the node's time, at the length it holds)
    D_ik <= n_i(k) * session_tokens_s * b_ik                         (its KV cache, swarm.planner.split)
    sum_source xp = m * sum_source x;  maximise sum_source x          (decode tokens/s at the workload's mix)

plus milp.py's compute cut on the decode flow and start order among identical nodes (identical here includes
the prefill and KV tables). Warm-started from a placement with its split LP flows, within a time limit; the
caller scores what it returns with the split LP on the whole cluster (links here are pruned as in milp.py).
"""

from __future__ import annotations

import time

import highspy
import numpy as np

from swarm.planner.cluster import Cluster
from swarm.planner.graph import valid_edges
from swarm.planner.milp import (
    MilpConfig,
    _add_cut_and_symmetry,
    _add_edges,
    _Helix,
    _highs,
    _node_columns,
    _read_placement,
    edge_valid,
    prune_links,
)
from swarm.planner.phases import KV_KEY, PREFILL_KEY, SplitConfig, phase_flows
from swarm.planner.placement import Placement
from swarm.types import SINK, SOURCE, NodeID


class _Phases:
    """The columns this module adds to milp.py's: prefill per edge, each node's phase shares per length."""

    def __init__(self) -> None:
        self.xp: dict[tuple[NodeID, NodeID], int] = {}
        self.shares: dict[NodeID, list[tuple[int, int]]] = {}  # per node, (P_ik, D_ik) for k = 1..cap


def solve_split_milp(
    cluster: Cluster, config: SplitConfig, warm: Placement, time_limit_s: float, prune_k: int = 8
) -> Placement | None:
    """A placement for split phases found within `time_limit_s` (None when HiGHS found none)."""
    started = time.perf_counter()
    keep = {(u, v) for u, v, _ in valid_edges(cluster, warm)}
    pruned = prune_links(cluster, prune_k, keep)
    helix = _node_columns(pruned)
    _add_edges(helix, pruned)
    phases = _Phases()
    _add_prefill_edges(helix, phases, pruned)
    _add_node_rows(helix, phases, pruned, config)
    source_d = {x: 1.0 for (u, _, x, _) in helix.edges if u == SOURCE}
    demand = {phases.xp[(u, v)]: 1.0 for (u, v, _, _) in helix.edges if u == SOURCE}
    helix.m.row(0.0, 0.0, demand | {x: -config.prompt_tokens_per_output for x in source_d})
    _add_cut_and_symmetry(helix, pruned, None, False)
    helix.groups = _same_phase_tables(pruned, helix)
    h = _highs(MilpConfig(), helix.m)
    values = _warm_values(pruned, warm, helix, phases, config)
    h.setSolution(len(values), np.arange(len(values), dtype=np.int32), np.array(values))
    h.setOptionValue("time_limit", max(time_limit_s - (time.perf_counter() - started), 0.05))
    h.run()
    if h.getInfo().primal_solution_status != 2:  # kSolutionStatusFeasible
        return None
    return _read_placement(helix, list(h.getSolution().col_value))


def _add_prefill_edges(helix: _Helix, phases: _Phases, pruned: Cluster) -> None:
    """xp per kept edge, valid with the edge (y) and sharing the link with the decode flow."""
    m = helix.m
    peak = {n.id: max(n.extra[PREFILL_KEY][: pruned.layer_cap(n)]) for n in helix.nodes}
    act, tok = pruned.model.activation_bytes_per_token, pruned.model.token_id_bytes
    for u, v, x, y in helix.edges:
        link = pruned.link_by_pair[(u, v)].bandwidth_bytes_s / (tok if u == SOURCE else act)
        big_m = min(link, *(peak[w] for w in (u, v) if w not in (SOURCE, SINK)))
        xp = phases.xp[(u, v)] = m.var(0.0, big_m)
        m.row(-highspy.kHighsInf, 0.0, {xp: 1.0, y: -big_m})
        m.row(-highspy.kHighsInf, link, {xp: 1.0, x: 1.0})


def _add_node_rows(helix: _Helix, phases: _Phases, pruned: Cluster, config: SplitConfig) -> None:
    """One length at most, end within the model, the phases' time and KV per length, conservation."""
    m, L = helix.m, pruned.model.num_layers
    for n in helix.nodes:
        i, b = n.id, helix.b[n.id]
        m.row(-highspy.kHighsInf, 1.0, {col: 1.0 for col in b})
        m.row(-highspy.kHighsInf, L, helix.end_terms(i, 1.0))
        shares = []
        for k, b_col in enumerate(b, 1):
            p_speed, d_speed = float(n.extra[PREFILL_KEY][k - 1]), n.tokens_s(k)
            p, d = m.var(0.0, max(p_speed, 0.0)), m.var(0.0, max(d_speed, 0.0))
            time_terms = {b_col: -1.0}
            if p_speed > 0:
                time_terms[p] = 1.0 / p_speed
            if d_speed > 0:
                time_terms[d] = 1.0 / d_speed
            m.row(-highspy.kHighsInf, 0.0, time_terms)
            if KV_KEY in n.extra:
                sessions = float(n.extra[KV_KEY][k - 1]) / config.session_tokens
                m.row(-highspy.kHighsInf, 0.0, {d: 1.0, b_col: -sessions * config.session_tokens_s})
            shares.append((p, d))
        phases.shares[i] = shares
        decode_in = [x for (_, v, x, _) in helix.edges if v == i]
        decode_out = [x for (u, _, x, _) in helix.edges if u == i]
        prefill_in = [phases.xp[(u, v)] for (u, v, _, _) in helix.edges if v == i]
        prefill_out = [phases.xp[(u, v)] for (u, v, _, _) in helix.edges if u == i]
        for part, ins, outs in ((0, prefill_in, prefill_out), (1, decode_in, decode_out)):
            through = {c[part]: -1.0 for c in shares}
            m.row(0.0, 0.0, {**{c: 1.0 for c in ins}, **through})
            m.row(0.0, 0.0, {**{c: 1.0 for c in outs}, **through})
        m.upper[helix.f[i]] = 0.0  # milp.py's one-kind flow column is unused here


def _same_phase_tables(pruned: Cluster, helix: _Helix) -> list[list[NodeID]]:
    """milp.py's identical groups, split further by the prefill and KV tables (symmetry must hold for both)."""
    out: list[list[NodeID]] = []
    for group in helix.groups:
        by_tables: dict[tuple[object, ...], list[NodeID]] = {}
        for i in group:
            extra = pruned.node_by_id[i].extra
            key = (tuple(extra.get(PREFILL_KEY, ())), tuple(extra.get(KV_KEY, ())))
            by_tables.setdefault(key, []).append(i)
        out.extend(g for g in by_tables.values() if len(g) > 1)
    return out


def _warm_values(
    pruned: Cluster, warm: Placement, helix: _Helix, phases: _Phases, config: SplitConfig
) -> list[float]:
    """A feasible column vector for `warm` with its split LP flows on the pruned links."""
    m = helix.m
    values = [0.0] * len(m.cost)
    flows = phase_flows(pruned, warm, config, split=True)
    decode = {(f.src, f.dst): f.tokens_s for f in flows.decode}
    prefill = {(f.src, f.dst): f.tokens_s for f in flows.prefill}
    for i, r in warm.items():
        if i not in helix.s:
            continue
        values[helix.s[i]] = float(r.start)
        values[helix.b[i][len(r) - 1]] = 1.0
        p, d = phases.shares[i][len(r) - 1]
        values[p] = sum(v for (_, dst), v in prefill.items() if dst == i)
        values[d] = sum(v for (_, dst), v in decode.items() if dst == i)
    for u, v, x, y in helix.edges:
        values[x] = min(decode.get((u, v), 0.0), m.upper[x])
        values[phases.xp[(u, v)]] = min(prefill.get((u, v), 0.0), m.upper[phases.xp[(u, v)]])
        valid = edge_valid(u, v, warm.get(u), warm.get(v), pruned.model.num_layers)
        values[y] = 1.0 if valid else 0.0
    return values
