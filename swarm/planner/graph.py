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

Link latency. Helix's network lets bandwidth cap a link, and nothing else: a link 10x slower than the rest
(1000 vs 100 Mbit/s, 5 vs 50 ms) rarely binds, since one token's hidden state (a few kB) is small against
compute, so the max flow is the same whether it uses the slow link or not, and preflow-push splits the flow
over the slow link and its alternatives as its push order happens to fall. Yet every token that crosses the
link waits its latency: for a decode token, which waits for the one before it, the route's summed link
delays are the token's time. So the plan keeps throughput first and latency second. A link's cost per token
is its one-way latency + its bytes per token / its bandwidth (the time one token's hidden state spends on
it); a link is slow when it costs clearly more than another link out of the same sender or into the same
receiver (its alternatives). Slow links carry no more than they do in the min-cost max flow (the max flow
whose tokens spend the least summed time on links); the rest of the flow is preflow-push's as before, on
the graph with the slow links capped so: a min-cost flow alone would pile every token on one of several
equally fast routes, where preflow-push spreads them over the replicas. A slow link then carries flow only
as far as the max flow needs it: none when the other links can carry the same tokens, which is when a good
alternative exists; with no slow link the flows are exactly preflow-push's. Latency does not
trade against throughput (a plan never serves fewer tokens/s to save a link's delay: the swarm's capacity
is what its many sessions share, and a lone session's latency is the client's route choice to make, see
swarm.routing.route); nor does it change the placement search, which scores placements by max flow alone
(the min-cost flow is computed once, for the chosen placement). One exception, for the plan a planner
publishes (`give`): peers of uneven speed would push one's surplus through the only other way across, a slow
link; the published flows may give up a small share of the max flow (a tenth by default) so that slow links
carry only what the fast ones lack for the rest.
"""

from __future__ import annotations

import time

import networkx as nx
from networkx.algorithms.flow import preflow_push

from swarm.planner.cluster import Cluster
from swarm.planner.placement import Placement
from swarm.types import SINK, SOURCE, EdgeFlow, NodeID, Plan, coverage

_SCALE = 1000.0  # integer capacities in milli-tokens/s
_COST_SCALE = 1e6  # integer link costs in microseconds per token
# A link is slow when it costs more than this factor times, plus this many microseconds over, the cheapest of
# its alternatives: re-measured links of one region differ by noise, which must not move the flows (and publish
# a new plan epoch) on every measurement round; a 10x slower link is far past it
_SLOW_FACTOR = 2.0
_SLOW_MARGIN = 1000


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


def link_cost_s(cluster: Cluster, src: NodeID, dst: NodeID) -> float:
    """Seconds one token spends on the link src -> dst: its latency plus its bytes over the bandwidth (token
    ids from the source, a hidden state otherwise); inf when there is no link."""
    link = cluster.link_by_pair.get((src, dst))
    if link is None or link.bandwidth_bytes_s <= 0:
        return float("inf")
    size = cluster.model.token_id_bytes if src == SOURCE else cluster.model.activation_bytes_per_token
    return link.latency_s + size / link.bandwidth_bytes_s


def max_flow(
    cluster: Cluster,
    placement: Placement,
    method: str = "evaluate",
    *,
    least_delay: bool = True,
    give: float = 0.0,
) -> Plan:
    """Max tokens/s through the placement and the flow on every edge that carries some.

    With `least_delay`, slow links carry no more flow than the least-delay max flow gives them (see the
    module docstring); without, whichever max flow preflow-push finds (the same value, for scoring many
    placements faster). `give` (with `least_delay`): the share of the max flow the plan may give up to keep
    tokens off slow links, which then carry only what the fast links lack for the rest (a published plan's
    flows; scoring and comparing keep the whole max flow). Nodes not in `placement` are idle. The placement
    is not checked here; see placement.check_placement.
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
        graph.add_edge(2 + 2 * i, 3 + 2 * i, capacity=int(cap * _SCALE), weight=0)
    for u, v, cap in valid_edges(cluster, placement):
        tail = 0 if u == SOURCE else 3 + 2 * index[u]
        head = 1 if v == SINK else 2 + 2 * index[v]
        cost = round(link_cost_s(cluster, u, v) * _COST_SCALE)
        graph.add_edge(tail, head, capacity=int(cap * _SCALE), weight=cost)
    if least_delay:
        _cap_slow_links(graph, give)
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


def link_flow_share(plan: Plan, src: NodeID, dst: NodeID) -> float:
    """The fraction of the plan's flow that crosses the link src -> dst (0 for a plan with no flow)."""
    if plan.max_flow_tokens_s <= 0:
        return 0.0
    on_link = sum(f.tokens_s for f in plan.flows if (f.src, f.dst) == (src, dst))
    return on_link / plan.max_flow_tokens_s


def _cap_slow_links(graph: nx.DiGraph, give: float) -> None:
    """Cap each slow link of `graph` (see the module docstring) at its flow in the min-cost flow of 1 - `give`
    of the max flow (the min-cost max flow when `give` is 0)."""
    hops = [(u, v, w) for u, v, w in graph.edges(data="weight") if not (u >= 2 and u % 2 == 0)]
    cheapest_out: dict[int, int] = {}
    cheapest_in: dict[int, int] = {}
    for u, v, w in hops:
        cheapest_out[u] = min(cheapest_out.get(u, w), w)
        cheapest_in[v] = min(cheapest_in.get(v, w), w)
    slow = [
        (u, v) for u, v, w in hops if w > min(cheapest_out[u], cheapest_in[v]) * _SLOW_FACTOR + _SLOW_MARGIN
    ]
    if not slow:
        return
    if give > 0:
        wanted = int(nx.maximum_flow_value(graph, 0, 1, flow_func=preflow_push) * (1.0 - give))
        demands = graph.copy()
        demands.nodes[0]["demand"], demands.nodes[1]["demand"] = -wanted, wanted
        least = nx.min_cost_flow(demands)
    else:
        least = nx.max_flow_min_cost(graph, 0, 1)
    for u, v in slow:
        graph[u][v]["capacity"] = least[u][v]


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
