"""The peer's rpc_* handlers: check a request against what this peer holds, compute, forward down the route.

A step carries the rest of its route. This peer computes its layers on the executor thread and pushes the
output straight to the next hop with call_step (which does the same), so the client sends one request per
token and only the last hop's output travels back up the chain. When the next hop fails, the error that comes
back names it (``failed_peer_id``), so the client knows whom to ban.

Sessions open implicitly on their first step and close on rpc_close, on idle timeout (``run()``), or when the
peer leaves (``drain()``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from swarm.errors import CapacityError, ModelMismatch, ProtocolError, SessionError
from swarm.models.blocks import Step
from swarm.models.spec import ModelSpec
from swarm.peer.executor import Executor
from swarm.transport.calls import call_close, call_forward, call_probe, call_step
from swarm.types import LayerRange
from swarm.wire import (
    CloseReply,
    CloseRequest,
    ForwardRequest,
    HopTiming,
    InfoReply,
    InfoRequest,
    ProbeReply,
    ProbeRequest,
    StepReply,
    StepRequest,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandlerConfig:
    """Session and forwarding limits of one peer."""

    session_idle_timeout_s: float = (
        120.0  # a session with no step for this long is closed and its cache freed
    )
    forward_timeout_s: float = (
        60.0  # deadline of the call to the next hop (which covers the rest of the route)
    )
    close_timeout_s: float = 5.0
    dial_back_timeout_s: float = 5.0
    max_sessions: int = 1024


@dataclass
class _Session:
    max_length_tokens: int
    last_used: float  # time.monotonic()


class PeerHandlers:
    """Implements swarm.transport.RpcHandler for one peer holding ``held`` layers of ``spec``."""

    def __init__(
        self,
        *,
        peer_id: str,
        name: str,
        p2p: P2P,
        executor: Executor,
        spec: ModelSpec,
        held: LayerRange,
        dtype: torch.dtype,
        config: HandlerConfig | None = None,
        state: Callable[[], str] = lambda: "serving",
    ) -> None:
        self.peer_id = peer_id
        self.name = name
        self.p2p = p2p
        self.executor = executor
        self.spec = spec
        self.held = held
        self.dtype = dtype
        self.config = config or HandlerConfig()
        self.state = state
        self.sessions: dict[str, _Session] = {}
        self.accepting = True  # False once the peer is leaving: open sessions finish, new ones are refused

    # ------------------------------------------------------------ checks

    def _check(self, model_hash: str, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor:
        if model_hash != self.spec.weights_hash:
            raise ModelMismatch(
                f"this peer serves {self.spec.name} with hash {self.spec.weights_hash[:12]}, "
                f"the request is for hash {model_hash[:12]}"
            )
        if not self.held.covers(LayerRange(start, end)):
            # Usually a stale route after this peer followed a new plan: an honest peer, so "route elsewhere"
            # (CapacityError) rather than ProtocolError, which would get it banned as misbehaving.
            raise CapacityError(f"layers {start}:{end} requested, this peer holds {self.held}")
        if hidden.shape[-1] != self.spec.hidden_size:
            raise ProtocolError(
                f"hidden size {hidden.shape[-1]} does not match the model's {self.spec.hidden_size}"
            )
        return hidden.to(self.dtype)

    # ------------------------------------------------------------ rpc_*

    async def rpc_step(self, request: StepRequest, remote_id: str) -> StepReply:
        received = time.perf_counter()
        hidden = self._check(request.model_hash, request.start, request.end, request.hidden)
        sid = request.session_id
        session = self.sessions.get(sid)
        if session is None:
            await self._open(sid, request.position, request.max_length_tokens)
        step = Step(sid, hidden, request.start, request.end, request.position)
        try:
            result = await self.executor.forward(step)
        finally:
            if sid in self.sessions:
                self.sessions[sid].last_used = time.monotonic()
        timing = HopTiming(self.peer_id, request.start, request.end, result.queue_s, result.compute_s, 0.0)
        if not request.route_rest:
            return StepReply(result.hidden, (_finish(timing, received),))
        hop, rest = request.route_rest[0], request.route_rest[1:]
        downstream = StepRequest(
            session_id=sid,
            position=request.position,
            hidden=result.hidden,
            start=hop.start,
            end=hop.end,
            max_length_tokens=request.max_length_tokens,
            model_hash=request.model_hash,
            route_rest=rest,
        )
        reply = await call_step(
            self.p2p, hop.peer_id, downstream, maddrs=hop.maddrs, timeout_s=self.config.forward_timeout_s
        )
        return StepReply(reply.hidden, (_finish(timing, received), *reply.timings))

    async def rpc_forward(self, request: ForwardRequest, remote_id: str) -> StepReply:
        received = time.perf_counter()
        hidden = self._check(request.model_hash, request.start, request.end, request.hidden)
        if not self.accepting:
            raise CapacityError("peer is leaving the swarm")
        result = await self.executor.forward(Step(None, hidden, request.start, request.end, 0))
        timing = HopTiming(self.peer_id, request.start, request.end, result.queue_s, result.compute_s, 0.0)
        if not request.route_rest:
            return StepReply(result.hidden, (_finish(timing, received),))
        hop = request.route_rest[0]
        downstream = ForwardRequest(
            result.hidden, hop.start, hop.end, request.model_hash, request.route_rest[1:]
        )
        reply = await call_forward(
            self.p2p, hop.peer_id, downstream, maddrs=hop.maddrs, timeout_s=self.config.forward_timeout_s
        )
        return StepReply(reply.hidden, (_finish(timing, received), *reply.timings))

    async def rpc_close(self, request: CloseRequest, remote_id: str) -> CloseReply:
        closed = await self._close(request.session_id)
        if request.route_rest:
            hop = request.route_rest[0]
            try:
                await call_close(
                    self.p2p,
                    hop.peer_id,
                    CloseRequest(request.session_id, request.route_rest[1:]),
                    maddrs=hop.maddrs,
                    timeout_s=self.config.close_timeout_s,
                )
            except Exception as e:  # best effort: the next hop frees the session on idle timeout anyway
                logger.info("could not close session on %s: %s", hop.peer_id[-8:], e)
        return CloseReply(closed)

    async def rpc_info(self, request: InfoRequest, remote_id: str) -> InfoReply:
        return InfoReply(
            peer_id=self.peer_id,
            name=self.name,
            model_name=self.spec.name,
            model_hash=self.spec.weights_hash,
            num_layers=self.spec.num_layers,
            hidden_size=self.spec.hidden_size,
            dtype=str(self.dtype).removeprefix("torch."),
            range_start=self.held.start,
            range_end=self.held.end,
            cache_tokens_total=self.cache_tokens_total,
            free_cache_tokens=self.free_cache_tokens,
            active_sessions=len(self.sessions),
            state=self.state(),
        )

    async def rpc_probe(self, request: ProbeRequest, remote_id: str) -> ProbeReply:
        ok: bool | None = None
        error = ""
        if request.dial_back_peer_id:
            try:
                await call_probe(
                    self.p2p,
                    request.dial_back_peer_id,
                    maddrs=request.dial_back_maddrs,
                    timeout_s=self.config.dial_back_timeout_s,
                )
                ok = True
            except Exception as e:  # any failure to dial back is the answer, not an error of this call
                ok, error = False, f"{type(e).__name__}: {e}"[:500]
        return ProbeReply(self.peer_id, len(request.payload), bytes(request.reply_bytes), ok, error)

    # ------------------------------------------------------------ sessions

    @property
    def cache_tokens_total(self) -> int:
        return int(self.executor.blocks.cache.cache_tokens)

    @property
    def free_cache_tokens(self) -> int:
        return int(self.executor.blocks.free_cache_tokens)

    async def _open(self, session_id: str, position: int, max_length_tokens: int) -> None:
        if position != 0:
            raise SessionError(
                f"unknown session {session_id[:16]} at position {position} (expired or never opened): "
                "reopen it and replay the prefix"
            )
        if not self.accepting:
            raise CapacityError("peer is leaving the swarm and takes no new sessions")
        if len(self.sessions) >= self.config.max_sessions:
            raise CapacityError(f"peer has {len(self.sessions)} open sessions, its limit")
        if max_length_tokens > self.free_cache_tokens:
            raise CapacityError(
                f"session needs {max_length_tokens} cache tokens, this peer has {self.free_cache_tokens} free"
            )
        # Reserve the slot before awaiting so two first steps of one session cannot both open it.
        self.sessions[session_id] = _Session(max_length_tokens, time.monotonic())
        try:
            await self.executor.open_session(session_id, max_length_tokens)
        except BaseException:
            self.sessions.pop(session_id, None)
            raise
        logger.debug("opened session %s (%d tokens)", session_id[:8], max_length_tokens)

    async def _close(self, session_id: str) -> bool:
        if self.sessions.pop(session_id, None) is None:
            return False
        await self.executor.close_session(session_id)
        logger.debug("closed session %s", session_id[:8])
        return True

    async def run(self) -> None:
        """Close sessions idle for longer than session_idle_timeout_s, until cancelled."""
        period_s = max(0.05, self.config.session_idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            for sid, session in list(self.sessions.items()):
                if now - session.last_used > self.config.session_idle_timeout_s:
                    logger.info("session %s idle for %.0f s: closing it", sid[:8], now - session.last_used)
                    await self._close(sid)

    async def drain(self, grace_s: float) -> None:
        """Stop taking new sessions; wait up to ``grace_s`` for open ones to close, then close the rest."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for sid in list(self.sessions):
            await self._close(sid)


def _finish(timing: HopTiming, received: float) -> HopTiming:
    total = time.perf_counter() - received
    return HopTiming(timing.peer_id, timing.start, timing.end, timing.queue_s, timing.compute_s, total)
