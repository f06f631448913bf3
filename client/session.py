"""An inference session over a route of peers, with failover by ban, re-route and replay.

The client keeps the embeddings and the LM head; the peers keep one KV cache per session, opened implicitly by
the first step. The session remembers every token the peers have seen (prompt plus generated), so whatever
goes wrong on the way it can rebuild the peers' caches: a failed step bans the peer at fault, builds a new
route for the layers from that peer's stage on (the stages before it stay: their peers are alive and hold the
cache), and sends all the tokens again at position 0, which makes every peer on the route truncate its cache
and recompute it. Greedy decoding after a failover therefore gives the same tokens as an uninterrupted run.

Who decides what is not here: client/retry.py maps each error to an action, and this module only acts on it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from typing import Protocol

import torch

from client.retry import Action, RetryPolicy
from swarm.errors import SwarmError, TransportError
from swarm.routing.route import Route, Stage, route_text
from swarm.types import SOURCE, NodeID, SessionID

logger = logging.getLogger(__name__)


class Head(Protocol):
    """The client-side ends of the model: token embeddings and the final norm + LM head."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # ids[T] -> hidden[T, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # hidden[T, H] -> logits[T, V]


class Chain(Protocol):
    """Carries hidden states through the stages of a route; remotely, each peer forwards to the next."""

    async def step(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        hidden: torch.Tensor,
        max_length_tokens: int,
    ) -> torch.Tensor: ...  # hidden[T, H] after the last stage

    async def close(self, session_id: SessionID, stages: Sequence[Stage]) -> None: ...

    async def find_silent(self, stages: Sequence[Stage], timeout_s: float) -> NodeID | None: ...


class RouteSource(Protocol):
    """Builds routes (or their tails, for failover) and remembers which peers to avoid."""

    async def route(self, start_layer: int, prev: NodeID, session_tokens: int) -> Route: ...  # NoRouteError

    def ban(self, peer_id: NodeID) -> None: ...


class InferenceSession:
    """One sequence being generated: call `forward(new_ids)` with the prompt, then with each new token."""

    def __init__(
        self,
        chain: Chain,
        routes: RouteSource,
        head: Head,
        num_layers: int,
        policy: RetryPolicy,
        step_timeout_s: float,
        max_length_tokens: int,
    ) -> None:
        self.chain = chain
        self.routes = routes
        self.head = head
        self.num_layers = num_layers
        self.policy = policy
        self.step_timeout_s = step_timeout_s
        self.max_length_tokens = max_length_tokens
        self.session_id = SessionID(secrets.token_hex(16))
        self.token_ids: list[int] = []  # every token the peers' caches hold, in order
        self.stages: Route = ()
        self.failovers = 0  # how many times a step was retried on a new route or replayed
        self._closed = False

    async def open(self) -> None:
        self.stages = await self.routes.route(0, SOURCE, self.max_length_tokens)
        logger.info("session %s route %s", self.session_id[:8], route_text(self.stages))

    @property
    def position(self) -> int:
        return len(self.token_ids)

    async def forward(self, new_ids: Sequence[int]) -> torch.Tensor:
        """Send `new_ids` through the swarm and return the logits[V] after the last of them."""
        if self._closed:
            raise SwarmError("the session is closed")
        if not new_ids:
            raise ValueError("forward needs at least one token")
        if self.position + len(new_ids) > self.max_length_tokens:
            raise ValueError(
                f"session would hold {self.position + len(new_ids)} tokens, "
                f"past max_length_tokens={self.max_length_tokens}"
            )
        if not self.stages:
            await self.open()
        replay = False
        attempt = 0
        while True:
            ids = [*self.token_ids, *new_ids] if replay else list(new_ids)
            position = 0 if replay else self.position
            hidden = self.head.embed(torch.tensor(ids, dtype=torch.long))
            try:
                async with asyncio.timeout(self.step_timeout_s):
                    out = await self.chain.step(
                        self.session_id, self.stages, position, hidden, self.max_length_tokens
                    )
                break
            except Exception as error:
                decision = self.policy.decide(error, attempt, self.stages[0].peer_id)
                if decision.action is Action.GIVE_UP:
                    raise
                logger.warning(
                    "session %s step failed at peer %s (%s: %s); %s, try %d",
                    self.session_id[:8],
                    (decision.failed_peer or "?")[-8:],
                    type(error).__name__,
                    error,
                    decision.action.value,
                    attempt + 1,
                )
                if decision.action is Action.REROUTE:
                    failed = await self._blame(error, decision.failed_peer)
                    self.routes.ban(failed)
                    await self._reroute(failed)
                elif decision.failed_peer is not None:
                    # REPLAY: the peer lost our cache (it restarted, or moved to other layers and dropped
                    # the session): no ban, but route afresh from it, in case it no longer holds its stage.
                    await self._reroute(decision.failed_peer)
                await asyncio.sleep(decision.delay_s)
                replay = True
                attempt += 1
                self.failovers += 1
        if out.dim() != 2 or out.shape[0] != len(ids):
            raise SwarmError(f"the route returned hidden of shape {list(out.shape)} for {len(ids)} tokens")
        self.token_ids.extend(int(t) for t in new_ids)
        return self.head.logits(out[-1:])[0]

    async def _blame(self, error: Exception, named: NodeID | None) -> NodeID:
        """The peer to ban. A timeout or broken connection may be reported by (or pinned on) a healthy hop
        while a peer further down hung or died, so ask each peer directly and blame the first silent one."""
        if isinstance(error, TransportError | TimeoutError | ConnectionError):
            silent = await self.chain.find_silent(self.stages, min(5.0, self.step_timeout_s))
            if silent is not None:
                return silent
        return named if named is not None else self.stages[0].peer_id

    async def _reroute(self, failed: NodeID) -> None:
        """Replace the stages from `failed`'s stage on; the stages before it are kept."""
        index = next((i for i, s in enumerate(self.stages) if s.peer_id == failed), 0)
        kept = self.stages[:index]
        start, prev = (kept[-1].layers.end, kept[-1].peer_id) if kept else (0, SOURCE)
        tail = await self.routes.route(start, prev, self.max_length_tokens)
        dropped = [s for s in self.stages[index + 1 :] if s.peer_id not in {t.peer_id for t in tail}]
        self.stages = (*kept, *tail)
        logger.info("session %s re-routed: %s", self.session_id[:8], route_text(self.stages))
        # Peers that left the route still hold our cache: ask them to drop it, one by one since the chain
        # through them is broken. Best effort: an unreachable peer frees it when the session expires.
        for stage in dropped:
            await self._close_quietly([stage])

    async def close(self) -> None:
        """Free the session's KV cache on every peer of the route. Never raises for a peer that is gone."""
        if self._closed:
            return
        self._closed = True
        if self.stages and self.token_ids:
            await self._close_quietly(self.stages)

    async def _close_quietly(self, stages: Sequence[Stage]) -> None:
        try:
            await self.chain.close(self.session_id, stages)
        except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
            logger.info("closing session %s: %s", self.session_id[:8], error)
