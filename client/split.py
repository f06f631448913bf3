"""Prefill on one route, decode on another (Splitwise in a swarm): which stages of a session move where.

After its prompt, a session moves each stage of its prefill route to a peer of its decode route: the stage's
peer hands the session's KV cache for the stage's layers to that peer (rpc_move, swarm.peer.handover), and the
session steps there from the same position, with nothing computed again.

A stage moves whole to one peer that holds all its layers, if the decode route has one there. Otherwise it
splits along the decode route's cuts: each part of its layers goes to the decode peer of those layers (the
source hands over one part at a time and keeps the session until all are in, then the client closes it
there); if any part fails, the stage stays whole where it is and the parts already sent are closed. A target
is never a peer already on the route, so the route names each peer once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarm.routing.route import Route, Stage
from swarm.types import LayerRange, NodeID


@dataclass(frozen=True)
class Move:
    """One stage's move (or one part of it) after the prompt, for logs, tests and benchmarks."""

    stage: Stage  # the stage on the prefill route
    target: NodeID  # the decode peer asked to take it
    tokens: int  # the session's position moved (0 if it failed)
    seconds: float  # from the ask to the target's confirmation (or the failure)
    error: str = ""  # why it stays on the prefill route; empty when it moved
    kv_bytes: int = 0  # the keys and values the stage's peer sent
    part: LayerRange | None = None  # the layers moved, if only some of the stage's


def cut(stage: Stage, decode: Stage) -> LayerRange | None:
    """The layers ``stage`` and ``decode`` share, if any."""
    start, end = max(stage.layers.start, decode.layers.start), min(stage.layers.end, decode.layers.end)
    return LayerRange(start, end) if start < end else None


def plan_moves(
    stages: Route, decode: Route, holds: Callable[[LayerRange, NodeID], bool]
) -> list[tuple[int, Route]]:
    """(index into ``stages``, the stages to take its place) for each stage that can move. Whole: to the peer of
    a decode stage overlapping it that holds all its layers (``holds(layers, peer)``). Else in parts, one per
    decode stage overlapping it, each to that stage's peer, if every one holds its part. Never to a peer on the
    route already or taken by an earlier stage."""
    taken = {s.peer_id for s in stages}
    out: list[tuple[int, Route]] = []
    for i, stage in enumerate(stages):
        over = [d for d in decode if cut(stage, d) is not None and d.peer_id not in taken]
        whole = next((d.peer_id for d in over if holds(stage.layers, d.peer_id)), None)
        if whole is not None:
            taken.add(whole)
            out.append((i, (Stage(whole, stage.layers),)))
            continue
        parts = tuple(Stage(d.peer_id, part) for d in decode if (part := cut(stage, d)) is not None)
        peers = {p.peer_id for p in parts}
        covered = sum(len(p.layers) for p in parts) == len(stage.layers)
        if (
            len(parts) > 1
            and covered
            and len(peers) == len(parts)
            and not peers & taken
            and all(holds(p.layers, p.peer_id) for p in parts)
        ):
            taken |= peers
            out.append((i, parts))
    return out


def moved_route(stages: Route, moves: list[Move]) -> tuple[Route, dict[Stage, Route]]:
    """``stages`` with each stage all of whose moves succeeded replaced by where it went, and which stages
    replaced which."""
    went: dict[Stage, list[Stage]] = {}
    failed = {m.stage for m in moves if m.error}
    for m in moves:
        if m.stage not in failed:
            went.setdefault(m.stage, []).append(Stage(m.target, m.part or m.stage.layers))
    replaced = {old: tuple(new) for old, new in went.items()}
    return tuple(s for old in stages for s in replaced.get(old, (old,))), replaced
