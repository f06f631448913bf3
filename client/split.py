"""Prefill on one route, decode on another (Splitwise in a swarm): which stages of a session move where.

After its prompt, a session moves each stage of its prefill route to a peer of its decode route: the stage's
peer hands the session's KV cache for the stage's layers to that peer (rpc_move, swarm.peer.handover), and the
session steps there from the same position, with nothing computed again.

A stage moves whole, to one peer, or not at all: its target must hold all of the stage's layers. A decode
route that cuts the layers elsewhere than the prefill route leaves the stages it straddles where they are (a
stage split between two receivers would need two partial hand-overs and a route cut anew, for a saving only
on those layers). A target is never a peer already on the route, so the route names each peer once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarm.routing.route import Route, Stage
from swarm.types import NodeID


@dataclass(frozen=True)
class Move:
    """One stage's move after the prompt, for logs, tests and benchmarks."""

    stage: Stage  # the stage on the prefill route
    target: NodeID  # the decode peer asked to take it
    tokens: int  # the session's position moved (0 if it failed)
    seconds: float  # from the ask to the target's confirmation (or the failure)
    error: str = ""  # why it stays on the prefill route; empty when it moved
    kv_bytes: int = 0  # the keys and values the stage's peer sent


def pair_stages(
    stages: Route, decode: Route, holds: Callable[[int, NodeID], bool]
) -> list[tuple[int, NodeID]]:
    """(index into ``stages``, peer of ``decode`` to move it to) for each stage that can move: a peer of a
    decode stage overlapping the stage's layers that holds all of them (``holds(index, peer)``), not on the
    route already and not taken by an earlier stage."""
    taken = {s.peer_id for s in stages}
    pairs = []
    for i, stage in enumerate(stages):
        for d in decode:
            overlaps = d.layers.start < stage.layers.end and stage.layers.start < d.layers.end
            if overlaps and d.peer_id not in taken and holds(i, d.peer_id):
                taken.add(d.peer_id)
                pairs.append((i, d.peer_id))
                break
    return pairs


def moved_route(stages: Route, moves: list[Move]) -> Route:
    """``stages`` with each stage that moved on its target."""
    targets = {m.stage: m.target for m in moves if not m.error}
    return tuple(Stage(targets[s], s.layers) if s in targets else s for s in stages)
