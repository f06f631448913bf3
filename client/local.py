"""The in-process chain: the client's sessions over BlockRanges held in this process instead of on peers.

LocalChain and LocalRoutes implement the same interfaces as RemoteChain and SwarmRoutes (client.session.Chain
and RouteSource), so `in_process_client` gives the very AsyncSwarmClient, InferenceSession and decode loop
that talk to a swarm, with each hop a direct call. The unit tests check that path against transformers
(failover included: a peer can be "killed" by name), and the benchmarks time it next to transformers.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from client.client import AsyncSwarmClient
from client.config import ClientConfig
from client.drafting import ModelDrafters
from client.routes import route_deprioritising_bans
from client.spot import ReportSink
from swarm.errors import CapacityError, SessionError, SwarmError, TransportError
from swarm.models.blocks import BlockRange, Step
from swarm.models.faults import OutputFaults
from swarm.models.head import ClientHead
from swarm.routing import BanConfig, BanList, PeerState, Route, Router, RoutingView
from swarm.routing.route import Stage
from swarm.types import LayerRange, NodeID, SessionID


class LocalChain:
    """Runs each stage on an in-process BlockRange, opening sessions on first use like a peer does."""

    def __init__(self, blocks: Mapping[NodeID, BlockRange]) -> None:
        self.blocks = dict(blocks)
        self.dead: set[NodeID] = set()  # peers that fail every call, as if SIGKILLed
        self.hung: set[NodeID] = set()  # peers that never answer, as if their machine lost power
        self.refusing: dict[NodeID, SwarmError] = {}  # peers that answer every step with this error
        self.faulty: dict[NodeID, OutputFaults] = {}  # peers that corrupt (some of) their outputs
        self.calls: list[tuple[NodeID, int, int]] = []  # (peer, position, tokens) of every stage run
        self.on_step: Callable[[int], None] | None = None  # called with the step count before each step
        # what each stage sent on, per (peer, session), as a peer logs it (swarm/peer/outputs.py): resends read it
        self.sent: dict[tuple[NodeID, SessionID], torch.Tensor] = {}
        self.resends: list[tuple[NodeID, int, int]] = []  # (peer, position, tokens) of every resend
        self.moves: list[tuple[NodeID, NodeID, int]] = []  # (from, to, tokens) of every session moved
        self._steps = 0

    async def step(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        hidden: torch.Tensor,
        max_length_tokens: int,
        *,
        relayed: bool = False,
        batch: tuple[str, int] = ("", 1),
    ) -> torch.Tensor:
        self._steps += 1
        if self.on_step is not None:
            self.on_step(self._steps)
        for stage in stages:
            if stage.peer_id in self.dead:
                error = TransportError(f"peer {stage.peer_id} is unreachable")
                error.failed_peer_id = stage.peer_id
                raise error
            if stage.peer_id in self.hung:
                await asyncio.Event().wait()  # until the caller gives up on the step
            if stage.peer_id in self.refusing:
                refusal = self.refusing[stage.peer_id]
                # an error that names another peer is this hop's claim that the other one failed
                refusal.failed_peer_id = refusal.failed_peer_id or stage.peer_id
                raise refusal
            block = self.blocks[stage.peer_id]
            if session_id not in block.active_sessions:
                block.open_session(session_id, max_length_tokens)
            inputs = hidden.to(block.device, block.dtype)
            try:
                hidden = self._forward(stage, session_id, inputs, position)
            except SwarmError as error:  # as a peer's reply does, the error names the hop it happened at
                error.failed_peer_id = error.failed_peer_id or stage.peer_id
                raise
            self.calls.append((stage.peer_id, position, inputs.shape[0]))
            self._log(stage.peer_id, session_id, position, hidden)
        return hidden

    def _log(self, peer_id: NodeID, session_id: SessionID, position: int, hidden: torch.Tensor) -> None:
        logged = self.sent.get((peer_id, session_id))
        if position == 0 or (logged is not None and position <= logged.shape[0]):
            kept = logged[:position] if logged is not None else hidden[:0]
            self.sent[(peer_id, session_id)] = torch.cat([kept, hidden.detach()])
        else:  # a gap: the log cannot vouch for what is missing
            self.sent.pop((peer_id, session_id), None)

    async def resend(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        tokens: int,
        hidden_size: int,
        max_length_tokens: int,
    ) -> None:
        kept = stages[0].peer_id
        if kept in self.dead:
            error = TransportError(f"peer {kept} is unreachable")
            error.failed_peer_id = kept
            raise error
        logged = self.sent.get((kept, session_id))
        if logged is None or logged.shape[0] < position + tokens or logged.shape[-1] != hidden_size:
            missing = SessionError(f"peer {kept} has no log of session {session_id[:8]} to resend")
            missing.failed_peer_id = kept
            raise missing
        self.resends.append((kept, position, tokens))
        await self.step(
            session_id, stages[1:], position, logged[position : position + tokens], max_length_tokens
        )

    def _forward(
        self, stage: Stage, session_id: SessionID, inputs: torch.Tensor, position: int
    ) -> torch.Tensor:
        block = self.blocks[stage.peer_id]
        step = Step(session_id, inputs, stage.layers.start, stage.layers.end, position)
        hidden = block.forward([step])[0]
        faults = self.faulty.get(stage.peer_id)
        return faults.corrupt(hidden) if faults is not None else hidden

    async def move(
        self,
        session_id: SessionID,
        stage: Stage,
        target: NodeID,
        timeout_s: float,
        part: LayerRange | None = None,
    ) -> tuple[int, int]:
        """Copy the session's cache for ``stage``'s layers (or ``part`` of them) to ``target``'s blocks and, for
        the whole stage, close it on the stage's peer, as rpc_move does between peers."""
        for peer_id in (stage.peer_id, target):
            if peer_id in self.dead:
                error = TransportError(f"peer {peer_id} is unreachable")
                error.failed_peer_id = peer_id
                raise error
        if target in self.refusing:
            raise self.refusing[target]
        source, dest = self.blocks[stage.peer_id], self.blocks[target]
        layers = part or stage.layers
        if not dest.range.covers(layers) or not stage.layers.covers(layers):
            raise CapacityError(f"layers {layers} requested, {target} holds {dest.range}")
        cache = source.cache.get(session_id)
        position = cache.lengths[stage.layers.start - cache.layers.start]
        dest.open_session(session_id, cache.max_length_tokens)
        moved, kv_bytes = dest.cache.get(session_id), 0
        for layer in range(layers.start, layers.end):
            k, v = cache.gather(layer, position)
            moved.append(layer, k.to(dest.device, dest.dtype), v.to(dest.device, dest.dtype))
            kv_bytes += 2 * k.numel() * k.element_size()
        if layers == stage.layers:
            source.close_session(session_id)
        self.moves.append((stage.peer_id, target, position))
        return position, kv_bytes

    async def run_alone(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor:
        if stage.peer_id in self.dead:
            raise TransportError(f"peer {stage.peer_id} is unreachable")
        block = self.blocks[stage.peer_id]
        session_id = SessionID(secrets.token_hex(16))
        block.open_session(session_id, hidden.shape[0])
        try:
            return self._forward(stage, session_id, hidden.to(block.device, block.dtype), 0)
        finally:
            block.close_session(session_id)

    async def close(self, session_id: SessionID, stages: Sequence[Stage]) -> None:
        for stage in stages:
            block = self.blocks.get(stage.peer_id)
            if stage.peer_id not in self.dead and block is not None and session_id in block.active_sessions:
                block.close_session(session_id)
            self.sent.pop((stage.peer_id, session_id), None)

    async def find_silent(self, stages: Sequence[Stage], timeout_s: float) -> NodeID | None:
        return next((s.peer_id for s in stages if s.peer_id in self.dead | self.hung), None)


class LocalRoutes:
    """Routes over the LocalChain's blocks by lowest latency (no plan), with real bans and withdrawals.

    Dead peers stay in the view, as they stay in the DHT until their record expires: only the withdrawal (or
    ban) that the session's failover sets keeps them out of new routes. A withdrawn peer is routable again once
    it is alive again (out of `chain.dead` and `chain.hung`), as a real one is once it re-announces.
    """

    def __init__(
        self,
        chain: LocalChain,
        num_layers: int,
        bans: BanConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        quant: str = "none",
    ) -> None:
        self.chain = chain
        self.num_layers = num_layers
        self.quant = quant  # routes go through blocks held so only (ClientConfig.quant)
        self.bans = BanList(clock, bans or BanConfig(base_s=60.0, max_s=60.0))
        self.router = Router(None, bans=self.bans)
        self.withdrawn: set[NodeID] = set()

    def view(self, avoid: frozenset[NodeID] = frozenset()) -> RoutingView:
        peers = [
            PeerState(peer_id, block.range, block.free_cache_tokens)
            for peer_id, block in self.chain.blocks.items()
            if peer_id not in avoid
            and block.quant == self.quant
            and not (peer_id in self.withdrawn and peer_id in self.chain.dead | self.chain.hung)
        ]
        return RoutingView.of(self.num_layers, peers)

    async def route(
        self,
        start_layer: int,
        prev: NodeID,
        session_tokens: int,
        avoid: frozenset[NodeID] = frozenset(),
        session_id: str = "",
    ) -> Route:
        """By lowest latency: with no plan there are no flows to weigh it against (`session_id` unused)."""
        return route_deprioritising_bans(self.router, self.view(avoid), start_layer, prev, session_tokens)

    def release(self, session_id: str) -> None:
        """Nothing to forget: routes here do not depend on the sessions open."""

    async def decode_route(self, session_tokens: int, avoid: frozenset[NodeID] = frozenset()) -> Route | None:
        """None: no plan here, so no decode flows (a session decodes where it prefilled unless told)."""
        return None

    async def holders(self, layers: LayerRange, like: NodeID | None = None) -> list[NodeID]:
        blocks = self.chain.blocks
        quant = blocks[like].quant if like is not None and like in blocks else None
        return [
            p
            for p, block in blocks.items()
            if block.range.covers(layers)
            and block.quant == self.quant
            and not self.bans.is_banned(p)
            and (quant is None or block.quant == quant)
        ]

    def ban(self, peer_id: NodeID) -> None:
        self.bans.ban(peer_id)

    def withdraw(self, peer_id: NodeID) -> None:
        self.withdrawn.add(peer_id)

    def succeeded(self, peer_ids: Iterable[NodeID]) -> None:
        for peer_id in peer_ids:
            self.bans.succeeded(peer_id)


def in_process_client(
    head: ClientHead,
    blocks: Mapping[str, BlockRange],
    tokenizer: Any = None,
    config: ClientConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
    reports: ReportSink | None = None,
    draft: ModelDrafters | None = None,
) -> AsyncSwarmClient:
    """An AsyncSwarmClient whose "peers" are `blocks` (named by the mapping's keys) in this process.

    Routes go by lowest latency over whichever blocks hold each layer; NoRouteError names layers none holds.
    `clock` times the bans (inject one to test them without waiting); `draft` is the model speculate="model"
    or "self" drafts with (client.draft_model.load_draft_model).
    """
    chain = LocalChain({NodeID(name): block for name, block in blocks.items()})
    num_layers, config = head.spec.num_layers, config or ClientConfig()
    return AsyncSwarmClient(
        config,
        chain=chain,
        routes=LocalRoutes(chain, num_layers, clock=clock, quant=config.quant),
        head=head,
        tokenizer=tokenizer,
        reports=reports,
        draft=draft,
    )
