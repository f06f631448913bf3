"""Placement -> flow network -> max flow: how many tokens/s a placement can serve.

The network (Helix's formulation, with FlowSwarm's client-side LM head):

    source --(bw / token_id_bytes)--> u_in --(throughput of u at len(u))--> u_out --> ... --> sink

* Each node is split into u_in -> u_out with capacity tokens_s_by_layers[len(range) - 1].
* source -> u when u holds layer 0 (the client sends token ids).
* u -> v when v holds the layer right after u's last: v.start <= u.end < v.end. Partial overlaps count:
  v may start inside u's range and simply skips the layers u already ran.
* u -> sink when u holds the last layer (the final hidden state goes back to the client's LM head).
* Every edge between machines is capped by its link's bandwidth divided by the bytes per token on it;
  with no link there is no edge.

Capacities are scaled to integer milli-tokens/s before networkx's preflow-push, which is exact on integers.
"""

from __future__ import annotations

import time

import networkx as nx
from networkx.algorithms.flow import preflow_push

from swarm.planner.cluster import Cluster
from swarm.planner.placement import Placement
from swarm.types import SINK, SOURCE, EdgeFlow, NodeID, Plan, coverage

_SCALE = 1000.0  # integer capacities in milli-tokens/s


def valid_edges(cluster: Cluster, placement: Placement) -> list[tuple[NodeID, NodeID, float]]:
    """(src, dst, capacity tokens/s) for every edge between machines that the placement makes valid.

    Edges with zero capacity (no link) are left out.
    """
    num_layers = cluster.model.num_layers
    act, tok = cluster.model.activation_bytes_per_token, cluster.model.token_id_bytes
    edges: list[tuple[NodeID, NodeID, float]] = []
    for u, ru in placement.items():
        if ru.start == 0:
            cap = cluster.bandwidth_bytes_s(SOURCE, u) / tok
            if cap > 0:
                edges.append((SOURCE, u, cap))
        if ru.end >= num_layers:
            cap = cluster.bandwidth_bytes_s(u, SINK) / act
            if cap > 0:
                edges.append((u, SINK, cap))
            continue
        for v, rv in placement.items():
            if v != u and rv.start <= ru.end < rv.end:
                cap = cluster.bandwidth_bytes_s(u, v) / act
                if cap > 0:
                    edges.append((u, v, cap))
    return edges


def node_capacity(cluster: Cluster, placement: Placement, node_id: NodeID) -> float:
    return cluster.node_by_id[node_id].tokens_s(len(placement[node_id]))


def max_flow(cluster: Cluster, placement: Placement, method: str = "evaluate") -> Plan:
    """Max tokens/s through the placement and the flow on every edge that carries some.

    Nodes not in `placement` are idle. The placement is not checked here; see placement.check_placement.
    """
    started = time.perf_counter()
    # Integer vertices (0 source, 1 sink, 2 + 2i node i in, 3 + 2i node i out): preflow-push keeps sets of
    # vertices, and a set of strings iterates in the order of the per-process hash seed, so with named
    # vertices the same placement got different (equally maximal) edge flows in different processes.
    nodes = list(placement)
    index = {node_id: i for i, node_id in enumerate(nodes)}
    graph = nx.DiGraph()
    graph.add_nodes_from(range(2 + 2 * len(nodes)))
    for i, node_id in enumerate(nodes):
        cap = node_capacity(cluster, placement, node_id)
        graph.add_edge(2 + 2 * i, 3 + 2 * i, capacity=int(cap * _SCALE))
    for u, v, cap in valid_edges(cluster, placement):
        tail = 0 if u == SOURCE else 3 + 2 * index[u]
        head = 1 if v == SINK else 2 + 2 * index[v]
        graph.add_edge(tail, head, capacity=int(cap * _SCALE))
    value, flow_dict = nx.maximum_flow(graph, 0, 1, flow_func=preflow_push)
    flows: list[EdgeFlow] = []
    for tail, heads in flow_dict.items():
        if tail == 1 or (tail >= 2 and tail % 2 == 0):
            continue  # the sink, or a node's internal edge (in -> out): not a hop between machines
        src = SOURCE if tail == 0 else nodes[(tail - 3) // 2]
        for head, amount in heads.items():
            if amount > 0:
                dst = SINK if head == 1 else nodes[(head - 2) // 2]
                flows.append(EdgeFlow(NodeID(src), NodeID(dst), amount / _SCALE))
    flows.sort(key=lambda f: (f.src != SOURCE, f.src, f.dst))
    return Plan(
        method=method,
        placement=dict(placement),
        max_flow_tokens_s=value / _SCALE,
        flows=tuple(flows),
        upper_bound_tokens_s=upper_bound(cluster),
        solve_s=time.perf_counter() - started,
    )


def coverage_score(cluster: Cluster, placement: Placement) -> float:
    """min over layers of the summed throughput of the nodes holding that layer (0 if a layer is bare).

    Every source-sink path passes through a node holding each layer, so this bounds the max flow from above;
    it equals the max flow when links do not bind (one fast region), at a fraction of the cost.
    """
    num_layers = cluster.model.num_layers
    delta = [0.0] * (num_layers + 1)
    for node_id, r in placement.items():
        t = node_capacity(cluster, placement, node_id)
        delta[r.start] += t
        delta[min(r.end, num_layers)] -= t
    if 0 in coverage(placement.values(), cluster.model.num_layers):
        return 0.0
    best, running = float("inf"), 0.0
    for layer in range(num_layers):
        running += delta[layer]
        best = min(best, running)
    return max(best, 0.0)


def upper_bound(cluster: Cluster) -> float:
    """A bound on the max flow of ANY valid placement of this cluster, in tokens/s.

    Proof sketch. Take any placement and any flow of F tokens/s. Each token's path covers the layers
    [0, L) and runs each of them once, so the path's nodes run L layer-steps per token in total, and node i
    runs at most len(range_i) of them per token that passes it. With f_i <= t_i(len_i) tokens/s through
    node i:  L * F <= sum_i len_i * f_i <= sum_i max_k k * t_i(k).  Hence the compute bound
    F <= sum_i max_k k * t_i(k) / L. Every token also crosses the cut {source} | rest (at most the summed
    bandwidth of source links / token_id_bytes) and the cut rest | {sink} (summed bandwidth of sink links /
    activation_bytes_per_token). The bound is the least of the three.
    """
    num_layers = cluster.model.num_layers
    compute = 0.0
    source_cut = 0.0
    sink_cut = 0.0
    for node in cluster.nodes:
        cap = cluster.layer_cap(node)
        if cap == 0:
            continue
        compute += max(k * node.tokens_s(k) for k in range(1, cap + 1))
        source_cut += cluster.bandwidth_bytes_s(SOURCE, node.id) / cluster.model.token_id_bytes
        sink_cut += cluster.bandwidth_bytes_s(node.id, SINK) / cluster.model.activation_bytes_per_token
    return min(compute / num_layers, source_cut, sink_cut)
