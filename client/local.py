"""In-process stand-ins for the swarm: a chain of BlockRanges and a route source over them.

They implement the same interfaces as RemoteChain and SwarmRoutes (client.session.Chain / RouteSource), so the
session, failover and generation logic can be checked against transformers without any network, and a peer
can be "killed" by name to exercise failover deterministically.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from swarm.errors import TransportError
from swarm.models.blocks import BlockRange, Step
from swarm.routing import BanConfig, BanList, PeerState, Route, Router, RoutingView
from swarm.routing.route import Stage
from swarm.types import NodeID, SessionID


class LocalChain:
    """Runs each stage on an in-process BlockRange, opening sessions on first use like a peer does."""

    def __init__(self, blocks: Mapping[NodeID, BlockRange]) -> None:
        self.blocks = dict(blocks)
        self.dead: set[NodeID] = set()  # peers that fail every call, as if SIGKILLed
        self.calls: list[tuple[NodeID, int, int]] = []  # (peer, position, tokens) of every stage run
        self.on_step: Callable[[int], None] | None = None  # called with the step count before each step
        self._steps = 0

    async def step(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        hidden: torch.Tensor,
        max_length_tokens: int,
    ) -> torch.Tensor:
        self._steps += 1
        if self.on_step is not None:
            self.on_step(self._steps)
        for stage in stages:
            if stage.peer_id in self.dead:
                error = TransportError(f"peer {stage.peer_id} is unreachable")
                error.failed_peer_id = stage.peer_id
                raise error
            block = self.blocks[stage.peer_id]
            if session_id not in block.active_sessions:
                block.open_session(session_id, max_length_tokens)
            step = Step(session_id, hidden.to(block.dtype), stage.layers.start, stage.layers.end, position)
            hidden = block.forward([step])[0]
            self.calls.append((stage.peer_id, position, step.hidden.shape[0]))
        return hidden

    async def close(self, session_id: SessionID, stages: Sequence[Stage]) -> None:
        for stage in stages:
            block = self.blocks.get(stage.peer_id)
            if stage.peer_id not in self.dead and block is not None and session_id in block.active_sessions:
                block.close_session(session_id)

    async def find_silent(self, stages: Sequence[Stage], timeout_s: float) -> NodeID | None:
        return next((s.peer_id for s in stages if s.peer_id in self.dead), None)


class LocalRoutes:
    """Routes over the LocalChain's blocks by lowest latency (no plan), with real bans.

    Dead peers stay in the view, as they stay in the DHT until their record expires: only the ban that
    the session's failover sets keeps them out of new routes.
    """

    def __init__(self, chain: LocalChain, num_layers: int, bans: BanConfig | None = None) -> None:
        self.chain = chain
        self.num_layers = num_layers
        self.bans = BanList(time.monotonic, bans or BanConfig(base_s=60.0, max_s=60.0))
        self.router = Router(None, bans=self.bans)

    def view(self) -> RoutingView:
        peers = [
            PeerState(peer_id, block.range, block.free_cache_tokens)
            for peer_id, block in self.chain.blocks.items()
        ]
        return RoutingView.of(self.num_layers, peers)

    async def route(self, start_layer: int, prev: NodeID, session_tokens: int) -> Route:
        return self.router.route_from(self.view(), start_layer, prev, session_tokens)

    def ban(self, peer_id: NodeID) -> None:
        self.bans.ban(peer_id)
