"""Checks and repairs on placements (node -> half-open layer range), shared by every planning method."""

from __future__ import annotations

from swarm.errors import PlanningError
from swarm.planner.cluster import Cluster
from swarm.types import LayerRange, NodeID, coverage

Placement = dict[NodeID, LayerRange]


def uncovered_layers(cluster: Cluster, placement: Placement) -> list[int]:
    return [layer for layer, c in enumerate(coverage(placement.values(), cluster.model.num_layers)) if c == 0]


def placement_problems(cluster: Cluster, placement: Placement) -> list[str]:
    """Everything that makes a placement invalid, as readable sentences (empty when valid)."""
    problems: list[str] = []
    for node_id, r in placement.items():
        node = cluster.node_by_id.get(node_id)
        if node is None:
            problems.append(f"node {node_id} is not in the cluster")
            continue
        if r.end > cluster.model.num_layers:
            problems.append(f"node {node_id} holds {r}, past the model's {cluster.model.num_layers} layers")
        if len(r) > cluster.layer_cap(node):
            problems.append(
                f"node {node_id} holds {len(r)} layers but fits at most {cluster.layer_cap(node)}"
            )
    missing = uncovered_layers(cluster, placement)
    if missing:
        problems.append(f"layers {_ranges(missing)} are held by no node")
    return problems


def check_placement(cluster: Cluster, placement: Placement) -> None:
    """Raise PlanningError saying what is wrong unless the placement is valid."""
    problems = placement_problems(cluster, placement)
    if problems:
        raise PlanningError("invalid placement: " + "; ".join(problems))


def check_feasible(cluster: Cluster) -> None:
    """Raise PlanningError when no valid placement exists: the nodes cannot hold every layer between them."""
    total = sum(cluster.layer_cap(n) for n in cluster.nodes)
    if total < cluster.model.num_layers:
        raise PlanningError(
            f"the {len(cluster.nodes)} nodes can hold {total} layers in total "
            f"but {cluster.model.name} has {cluster.model.num_layers}: no valid placement exists"
        )


def repair(cluster: Cluster, placement: Placement) -> Placement:
    """Make a placement valid with small changes: clip ranges to caps, then cover each gap.

    A gap is filled by the node with spare capacity whose range can be extended or moved over it at the least
    loss of throughput; idle nodes are used before stretching busy ones. Raises PlanningError if infeasible.
    """
    check_feasible(cluster)
    num_layers = cluster.model.num_layers
    fixed: Placement = {}
    for node_id, r in placement.items():
        node = cluster.node_by_id.get(node_id)
        if node is None or cluster.layer_cap(node) == 0:
            continue
        end = min(r.end, num_layers, r.start + cluster.layer_cap(node))
        if end > r.start:
            fixed[node_id] = LayerRange(r.start, end)
    for _ in range(num_layers + len(cluster.nodes)):
        missing = uncovered_layers(cluster, fixed)
        if not missing:
            return fixed
        gap_start = missing[0]
        gap_end = gap_start
        while gap_end < num_layers and gap_end in missing:
            gap_end += 1
        fixed = _fill_gap(cluster, fixed, gap_start, gap_end)
    raise PlanningError("could not repair the placement to cover every layer")


def _fill_gap(cluster: Cluster, placement: Placement, gap_start: int, gap_end: int) -> Placement:
    """Cover as much of [gap_start, gap_end) as one node can, choosing the node that loses least."""
    best: tuple[tuple[int, float, str], NodeID, LayerRange] | None = None
    for node in cluster.nodes:
        cap = cluster.layer_cap(node)
        if cap == 0:
            continue
        current = placement.get(node.id)
        if current is not None and current.end == gap_start and len(current) < cap:
            # Extend an adjacent range rightwards: keeps the node's layers, adds the gap's head.
            new = LayerRange(current.start, min(gap_end, current.start + cap))
        elif current is not None and current.start == gap_end and len(current) < cap:
            new = LayerRange(max(gap_start, current.end - cap), current.end)
        elif current is None:
            new = LayerRange(gap_start, min(gap_end, gap_start + cap))
        else:
            continue
        # Prefer idle nodes (nothing lost elsewhere), then the fastest at the new length.
        key = (0 if current is None else 1, -node.tokens_s(len(new)), str(node.id))
        if best is None or key < best[0]:
            best = (key, node.id, new)
    if best is None:
        # Every node is busy and not adjacent: move the node whose move loses least coverage elsewhere.
        counts = coverage(placement.values(), cluster.model.num_layers)
        movable = [
            (min(counts[r.start : r.end]), node_id)
            for node_id, r in placement.items()
            if min(counts[r.start : r.end]) > 1
        ]
        if not movable:
            raise PlanningError(f"cannot cover layers {gap_start}:{gap_end}: no node can be spared")
        _, node_id = max(movable)
        cap = cluster.layer_cap(cluster.node_by_id[node_id])
        out = dict(placement)
        out[node_id] = LayerRange(gap_start, min(gap_end, gap_start + cap))
        return out
    out = dict(placement)
    out[best[1]] = best[2]
    return out


def new_layers(current: Placement | None, placement: Placement) -> int:
    """Layers that nodes must load anew to go from `current` to `placement` (the reload cost's count)."""
    if not current:
        return 0
    total = 0
    for node_id, r in placement.items():
        old = current.get(node_id)
        overlap = r.intersect(old) if old is not None else None
        total += len(r) - (len(overlap) if overlap is not None else 0)
    return total


def _ranges(layers: list[int]) -> str:
    parts: list[list[int]] = []
    for layer in layers:
        if parts and parts[-1][1] == layer:
            parts[-1][1] = layer + 1
        else:
            parts.append([layer, layer + 1])
    return ", ".join(f"{a}:{b}" for a, b in parts)
