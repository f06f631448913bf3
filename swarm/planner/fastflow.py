"""Max-flow VALUE of a placement, fast enough to score thousands of candidates in local search.

Same network as graph.max_flow (see its docstring) but built on integer vertex ids and solved with Dinic's
algorithm on floats; graph.max_flow (networkx preflow-push, integer-scaled) stays the reference that plans
are published with, and a unit test checks the two agree.
"""

from __future__ import annotations

from swarm.planner.cluster import Cluster
from swarm.types import SINK, SOURCE, NodeID

_EPS = 1e-9


class FlowScorer:
    """Precomputes per-cluster capacities so each call only rebuilds the placement-dependent edges."""

    def __init__(self, cluster: Cluster, node_ids: list[NodeID]) -> None:
        self.num_layers = cluster.model.num_layers
        self.node_ids = node_ids
        act, tok = cluster.model.activation_bytes_per_token, cluster.model.token_id_bytes
        n = len(node_ids)
        self.source_cap = [cluster.bandwidth_bytes_s(SOURCE, u) / tok for u in node_ids]
        self.sink_cap = [cluster.bandwidth_bytes_s(u, SINK) / act for u in node_ids]
        self.hop_cap = [[cluster.bandwidth_bytes_s(u, v) / act for v in node_ids] for u in node_ids]
        self.tables = [(0.0, *cluster.node_by_id[u].tokens_s_by_layers) for u in node_ids]
        self.n = n

    def value(self, starts: list[int], counts: list[int]) -> float:
        """Max flow for node i holding [starts[i], starts[i] + counts[i]) (count 0: idle)."""
        n, num_layers = self.n, self.num_layers
        # Vertices: 0 = source, 1 = sink, 2 + 2i = node i in, 3 + 2i = node i out.
        size = 2 + 2 * n
        head: list[list[int]] = [[] for _ in range(size)]
        to: list[int] = []
        cap: list[float] = []

        def add(a: int, b: int, c: float) -> None:
            head[a].append(len(to))
            to.append(b)
            cap.append(c)
            head[b].append(len(to))
            to.append(a)
            cap.append(0.0)

        active = [i for i in range(n) if counts[i] > 0]
        by_start = sorted(active, key=lambda i: starts[i])
        for u in active:
            su, eu = starts[u], starts[u] + counts[u]
            add(2 + 2 * u, 3 + 2 * u, self.tables[u][counts[u]])
            if su == 0 and self.source_cap[u] > 0:
                add(0, 2 + 2 * u, self.source_cap[u])
            if eu >= num_layers:
                if self.sink_cap[u] > 0:
                    add(3 + 2 * u, 1, self.sink_cap[u])
                continue
            row = self.hop_cap[u]
            for v in by_start:
                if starts[v] > eu:
                    break
                if v != u and eu < starts[v] + counts[v] and row[v] > 0:
                    add(3 + 2 * u, 2 + 2 * v, row[v])
        return _dinic(size, head, to, cap, 0, 1)


def _dinic(size: int, head: list[list[int]], to: list[int], cap: list[float], s: int, t: int) -> float:
    total = 0.0
    while True:
        level = [-1] * size
        level[s] = 0
        queue = [s]
        for a in queue:
            for e in head[a]:
                if cap[e] > _EPS and level[to[e]] < 0:
                    level[to[e]] = level[a] + 1
                    queue.append(to[e])
        if level[t] < 0:
            return total
        it = [0] * size
        while True:
            pushed = _augment(s, t, float("inf"), level, it, head, to, cap)
            if pushed <= _EPS:
                break
            total += pushed


def _augment(
    a: int,
    t: int,
    limit: float,
    level: list[int],
    it: list[int],
    head: list[list[int]],
    to: list[int],
    cap: list[float],
) -> float:
    """One blocking-flow augmenting path from a (iterative DFS would be faster; paths here are short)."""
    if a == t:
        return limit
    edges = head[a]
    while it[a] < len(edges):
        e = edges[it[a]]
        b = to[e]
        if cap[e] > _EPS and level[b] == level[a] + 1:
            pushed = _augment(b, t, min(limit, cap[e]), level, it, head, to, cap)
            if pushed > _EPS:
                cap[e] -= pushed
                cap[e ^ 1] += pushed
                return pushed
        it[a] += 1
    return 0.0
