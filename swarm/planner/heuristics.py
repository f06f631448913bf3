"""Baseline placements, each a cheap heuristic from prior systems; every result is repaired to be valid.

* petals_greedy: Petals' block selection. Nodes join one by one (fastest first), each takes as many layers as
  it fits, placed where the layers' current summed throughput is lowest.
* swarm_stages: SWARM parallelism. The model is cut into equal stages; nodes are dealt to stages so that each
  stage's summed throughput is balanced. The stage count with the best bottleneck wins.
* separate_pipelines: one pipeline (or several) per (region, GPU type): nodes of a kind chain up to hold the
  whole model among themselves; kinds too small to hold it alone are pooled per region, then globally.
"""

from __future__ import annotations

from swarm.planner.cluster import Cluster, ClusterNode
from swarm.planner.graph import coverage_score
from swarm.planner.placement import Placement, check_feasible, repair
from swarm.types import LayerRange


def _by_speed(cluster: Cluster) -> list[ClusterNode]:
    """Nodes that can hold something, fastest (at full load) first, ids breaking ties."""
    usable = [n for n in cluster.nodes if cluster.layer_cap(n) > 0]
    return sorted(usable, key=lambda n: (-cluster.layer_cap(n) * n.tokens_s(cluster.layer_cap(n)), n.id))


def petals_greedy(cluster: Cluster) -> Placement:
    check_feasible(cluster)
    num_layers = cluster.model.num_layers
    throughput = [0.0] * num_layers
    placement: Placement = {}
    for node in _by_speed(cluster):
        k = cluster.layer_cap(node)
        # Lowest-throughput window of k layers; Petals compares the windows' bottleneck, then their sum.
        best_start = min(
            range(num_layers - k + 1),
            key=lambda s: (min(throughput[s : s + k]), sum(throughput[s : s + k]), s),
        )
        placement[node.id] = LayerRange(best_start, best_start + k)
        for layer in range(best_start, best_start + k):
            throughput[layer] += node.tokens_s(k)
    return repair(cluster, placement)


def swarm_stages(cluster: Cluster) -> Placement:
    check_feasible(cluster)
    num_layers = cluster.model.num_layers
    nodes = _by_speed(cluster)
    best: tuple[float, Placement] | None = None
    for num_stages in range(1, num_layers + 1):
        stage_len = -(-num_layers // num_stages)
        bounds = [(s * stage_len, min((s + 1) * stage_len, num_layers)) for s in range(num_stages)]
        bounds = [(a, b) for a, b in bounds if a < b]
        eligible = [n for n in nodes if cluster.layer_cap(n) >= stage_len]
        if len(eligible) < len(bounds):
            continue
        # Deal the fastest remaining node to the currently weakest stage (longest-processing-time rule).
        stage_sum = [0.0] * len(bounds)
        placement: Placement = {}
        for node in sorted(eligible, key=lambda n: (-n.tokens_s(stage_len), n.id)):
            s = min(range(len(bounds)), key=lambda i: (stage_sum[i], i))
            a, b = bounds[s]
            placement[node.id] = LayerRange(a, b)
            stage_sum[s] += node.tokens_s(b - a)
        score = coverage_score(cluster, placement)
        if best is None or score > best[0]:
            best = (score, placement)
    if best is None:
        return petals_greedy(cluster)  # no node fits even one equal stage of the model alone
    return repair(cluster, best[1])


def separate_pipelines(cluster: Cluster) -> Placement:
    check_feasible(cluster)
    groups: dict[tuple[str, str], list[ClusterNode]] = {}
    for node in _by_speed(cluster):
        kind = str(node.extra.get("gpu", f"{node.max_layers}x{node.tokens_s_by_layers[:1]}"))
        groups.setdefault((node.region, kind), []).append(node)
    placement: Placement = {}
    leftovers_by_region: dict[str, list[ClusterNode]] = {}
    for (region, _), members in sorted(groups.items()):
        rest = _chain_pipelines(cluster, members, placement)
        leftovers_by_region.setdefault(region, []).extend(rest)
    global_rest: list[ClusterNode] = []
    for _, members in sorted(leftovers_by_region.items()):
        global_rest.extend(_chain_pipelines(cluster, members, placement))
    _chain_pipelines(cluster, global_rest, placement)
    return repair(cluster, placement)


def _chain_pipelines(cluster: Cluster, members: list[ClusterNode], placement: Placement) -> list[ClusterNode]:
    """Cut `members` (fastest first) into pipelines that each hold the whole model; return the unused nodes.

    Within a pipeline, layers are split in proportion to each node's capacity so stages stay balanced.
    """
    num_layers = cluster.model.num_layers
    pending = list(members)
    while pending:
        chain: list[ClusterNode] = []
        held = 0
        for node in list(pending):
            if held >= num_layers:
                break
            chain.append(node)
            pending.remove(node)
            held += cluster.layer_cap(node)
        if held < num_layers:
            return chain + pending
        caps = [cluster.layer_cap(n) for n in chain]
        # Shrink every node's share evenly from its cap until the chain holds exactly num_layers layers.
        shares = _balanced_shares(caps, num_layers)
        start = 0
        for node, share in zip(chain, shares, strict=True):
            if share > 0:
                placement[node.id] = LayerRange(start, start + share)
                start += share
    return []


def _balanced_shares(caps: list[int], total: int) -> list[int]:
    """Split `total` layers over nodes with these caps, as evenly as the caps allow."""
    shares = [0] * len(caps)
    remaining = total
    while remaining > 0:
        open_ = [i for i in range(len(caps)) if shares[i] < caps[i]]
        each = max(1, remaining // len(open_))
        for i in open_:
            add = min(each, caps[i] - shares[i], remaining)
            shares[i] += add
            remaining -= add
            if remaining == 0:
                break
    return shares
