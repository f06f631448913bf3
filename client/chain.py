"""The remote chain: one step of a session goes to the route's first peer, which forwards it peer to peer.

The client sends the hidden states once, to the first stage, with the rest of the route as `route_rest`; each
peer computes its layers and pushes the result to the next hop itself. The last hop's output comes straight
back to the client: with the step (sent with `wait_result`) goes a StepWait to the last hop, which answers it
with the output, while the step's own call returns as soon as every hop has accepted it. So a decode step costs
one message per hop plus one back, and no peer relays the output (see swarm.peer.handoff). A one-stage route
just calls its peer. Since the client never holds the states between hops, a failover that replaced some
stages asks the kept hop before them to resend what it sent on (``resend``, swarm.peer.outputs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P

from client.grouping import Groups, groupable
from swarm.codec import ActivationConfig, choose_codec
from swarm.dht import PeerRecord
from swarm.errors import SwarmError
from swarm.routing.route import Stage
from swarm.transport import (
    call_close,
    call_info,
    call_move,
    call_step,
    call_step_acked,
    call_step_batch,
    call_wait,
    call_wait_batch,
)
from swarm.types import LayerRange, NodeID, SessionID
from swarm.wire import CloseRequest, Hop, MoveRequest, StepAck, StepReply, StepRequest, StepWait

logger = logging.getLogger(__name__)

Maddrs = Callable[[NodeID], tuple[str, ...]]  # where a peer listens, from the latest DHT snapshot
Records = Callable[[NodeID], PeerRecord | None]  # what a peer announced, from the latest DHT snapshot
# A round's steps to one first hop wait this long for their mates before going as one message: members send
# within a pass or two of the event loop once the round settled (client.batching.Round).
GROUP_WAIT_S = 0.005
_Wait = tuple[StepWait, int]  # a wait and the bytes of the output it waits for
_R = TypeVar("_R")
RELEASE_TIMEOUT_S = (
    0.001  # the deadline of a wait sent only to fail an earlier one (RemoteChain._release_wait)
)


def _forget_when_done(pending: set[asyncio.Future[_R]]) -> Callable[[asyncio.Future[_R]], None]:
    """A done-callback for a call nobody awaits: drop it from ``pending`` and retrieve its error, if any (the
    short deadline of a release; a late acknowledgement's failure, after the output came)."""

    def done(call: asyncio.Future[_R]) -> None:
        pending.discard(call)
        if not call.cancelled():
            call.exception()

    return done


class RemoteChain:
    """Runs session steps through real peers over hivemind P2P (see swarm.transport)."""

    def __init__(
        self,
        p2p: P2P,
        maddrs: Maddrs,
        model_hash: str,
        wire_dtype: torch.dtype,
        step_timeout_s: float,
        close_timeout_s: float,
        group_messages: bool = True,
        activations: ActivationConfig | None = None,
        records: Records = lambda _peer_id: None,
    ) -> None:
        self.p2p = p2p
        self.maddrs = maddrs
        self.model_hash = model_hash
        self.wire_dtype = wire_dtype  # hidden states travel in the swarm's dtype, not the client's
        self.step_timeout_s = step_timeout_s
        self.close_timeout_s = close_timeout_s
        self.group_messages = group_messages
        # the codec of our own hops: to the route's first peer, and back from its last one
        self.activations = activations or ActivationConfig()
        self.records = records
        self._releasing: set[asyncio.Future[StepReply]] = set()  # waits sent to release a grouped one
        # acknowledgements of steps whose output came first, left to arrive (_step_and_wait)
        self._acknowledging: set[asyncio.Future[StepAck | StepReply]] = set()
        # a round's steps to one first hop, and its waits at one last hop, each as one message (client.grouping)
        self.steps: Groups[StepRequest, StepAck | StepReply] = Groups(
            self._send_steps, self._send_step, GROUP_WAIT_S
        )
        self.waits: Groups[_Wait, StepReply] = Groups(self._send_waits, self._send_wait, GROUP_WAIT_S)

    async def _send_steps(
        self, hop: Hop, requests: list[StepRequest]
    ) -> list[StepAck | StepReply | SwarmError]:
        return await call_step_batch(
            self.p2p, hop.peer_id, requests, maddrs=hop.maddrs, timeout_s=self.step_timeout_s
        )

    async def _send_step(self, hop: Hop, request: StepRequest) -> StepAck | StepReply:
        if request.wait_result:
            return await call_step_acked(
                self.p2p, hop.peer_id, request, maddrs=hop.maddrs, timeout_s=self.step_timeout_s
            )
        return await call_step(
            self.p2p, hop.peer_id, request, maddrs=hop.maddrs, timeout_s=self.step_timeout_s
        )

    async def _send_waits(self, hop: Hop, waits: list[_Wait]) -> list[StepReply | SwarmError]:
        return await call_wait_batch(
            self.p2p,
            hop.peer_id,
            [wait for wait, _ in waits],
            maddrs=hop.maddrs,
            timeout_s=self.step_timeout_s,
            reply_bytes_hint=sum(size for _, size in waits),
        )

    async def _send_wait(self, hop: Hop, wait: _Wait) -> StepReply:
        return await call_wait(
            self.p2p,
            hop.peer_id,
            wait[0],
            maddrs=hop.maddrs,
            timeout_s=self.step_timeout_s,
            reply_bytes_hint=wait[1],
        )

    def _release_wait(self, request: StepRequest, last: Hop) -> None:
        """Our wait for ``request``'s output may sit at the last hop in a message with the round's other waits,
        whose answer comes once every wait in it has one: the step failed before it got there, so the wait would
        hold its mates until its deadline. A newer wait for the same step fails it there at once (swarm.peer.
        handoff); this one ends at its own short deadline, and nobody reads it."""
        wait = StepWait(request.session_id, request.position, RELEASE_TIMEOUT_S)
        call = asyncio.ensure_future(
            call_wait(self.p2p, last.peer_id, wait, maddrs=last.maddrs, timeout_s=self.close_timeout_s)
        )
        self._releasing.add(call)  # held until done: the loop keeps only weak references to tasks
        call.add_done_callback(_forget_when_done(self._releasing))

    def _grouped(self, request: StepRequest) -> bool:
        """Whether ``request`` goes with its round's other steps to the first hop, and its wait with theirs."""
        return self.group_messages and groupable(request)

    async def _send_first(self, request: StepRequest, first: Hop) -> StepAck | StepReply:
        """``request`` to the route's first hop: with the round's other steps to it as one message, or alone."""
        if self._grouped(request):
            return await self.steps.send(first, (request.batch_id, request.batch_size), request)
        return await self._send_step(first, request)

    async def _wait_last(self, request: StepRequest, last: Hop) -> StepReply:
        """The output of ``request`` at the route's last hop: waited for with the round's others there as one
        message, or alone."""
        wait = (
            StepWait(request.session_id, request.position, self.step_timeout_s, self._codec(last, request)),
            request.hidden.numel() * request.hidden.element_size(),
        )
        if self._grouped(request):
            return await self.waits.send(last, (request.batch_id, request.batch_size), wait)
        return await self._send_wait(last, wait)

    def _codec(self, hop: Hop, request: StepRequest) -> str:
        """How hidden states travel between us and ``hop`` (swarm.codec): exact for a lossless step, else as
        configured; auto weighs the link against the hop's compute, both as the peer announced them (its best
        measured link standing for ours, which we do not measure)."""
        if request.lossless:
            return "exact"
        record = self.records(NodeID(hop.peer_id))
        # our states go into the peer: its download, the links' reverse direction (upload where not announced)
        links = record.links.values() if record else ()
        bandwidth = max(
            (link.reverse_bandwidth_bytes_s or link.bandwidth_bytes_s for link in links), default=None
        )
        speed = record.prefill_layer_tokens_s if record is not None else 0.0
        return choose_codec(
            self.activations.mode,
            self.wire_dtype,
            int(request.hidden.shape[-1]),
            bandwidth,
            (hop.end - hop.start) / speed if speed > 0 else None,
            self.activations.auto_fraction,
        )

    def _hops(self, stages: Sequence[Stage]) -> tuple[Hop, ...]:
        return tuple(
            Hop(str(s.peer_id), self.maddrs(s.peer_id), s.layers.start, s.layers.end) for s in stages
        )

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
        """``batch``: (id, size) of the client's decode steps sent together with this one (StepRequest)."""
        first, *rest = self._hops(stages)
        request = StepRequest(
            session_id=session_id,
            position=position,
            hidden=hidden.to(self.wire_dtype),
            start=first.start,
            end=first.end,
            max_length_tokens=max_length_tokens,
            model_hash=self.model_hash,
            route_rest=tuple(rest),
            timeout_s=self.step_timeout_s,  # the route stops working on it when we stop waiting
            wait_result=bool(rest) and not relayed,
            batch_id=batch[0],
            batch_size=batch[1],
            # a relayed step (a spot-check's route check, the step after a failover) goes exact on every hop
            lossless=relayed,
        )
        request = replace(request, codec=self._codec(first, request))
        if not request.wait_result:
            reply = await self._send_first(request, first)
            if not isinstance(reply, StepReply):
                raise SwarmError(f"peer {first.peer_id} acknowledged a step that asked for its output")
        else:
            reply = await self._step_and_wait(request, first, rest[-1])
        return reply.hidden.to(hidden.dtype)

    async def _step_and_wait(self, request: StepRequest, first: Hop, last: Hop) -> StepReply:
        """Send ``request`` down the route and wait for its output at ``last``. The output, once here, is the
        answer even if the step's acknowledgement has not come yet: every hop has taken the step, and a hop may
        hold the acknowledgement back with those of other sessions sent on with it (swarm.peer.forwarding). A
        failed step raises its error, naming the failed hop, and cancels the wait; a failed wait raises once the
        step's outcome is known, the step's error first (it names the hop that failed; its acknowledgement may
        then come only when the slowest step sent on with it is taken, at worst at its deadline)."""
        waiter = asyncio.ensure_future(self._wait_last(request, last))
        stepping = asyncio.ensure_future(self._send_first(request, first))
        calls = [stepping, waiter]
        try:
            await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                if not stepping.done():
                    # The acknowledgement is on its way: let it come on its stream in the background. Cancelled,
                    # the call would close its stream (half-way, out of step), and the next step would open a
                    # fresh one through p2pd, costing several frames' worth on an open stream
                    # (docs/benchmarks.md).
                    calls.remove(stepping)
                    self._acknowledging.add(stepping)
                    stepping.add_done_callback(_forget_when_done(self._acknowledging))
                return waiter.result()
            await stepping  # a failed step names the hop that failed: its error goes first
            return await waiter
        finally:
            for call in calls:
                if not call.done():
                    call.cancel()
            await asyncio.wait(calls)
            if waiter.cancelled() and self._grouped(request):
                self._release_wait(request, last)
            for call in calls:
                if not call.cancelled():
                    call.exception()  # retrieved, so asyncio does not log it as lost

    async def resend(
        self,
        session_id: SessionID,
        stages: Sequence[Stage],
        position: int,
        tokens: int,
        hidden_size: int,
        max_length_tokens: int,
    ) -> None:
        """Have ``stages[0]`` send the outputs it logged for [position, +tokens) of the session on through
        ``stages[1:]``, which fill their caches (it computes nothing; see swarm.peer.outputs). Their output
        is waited for at the last of them, as any step's, and dropped. SessionError if it has no such log."""
        first, *rest = self._hops(stages)
        if not rest:
            raise ValueError("a resend needs stages to send to")
        request = StepRequest(
            session_id=session_id,
            position=position,
            hidden=torch.empty(0, hidden_size, dtype=self.wire_dtype),  # only H goes on the wire
            start=first.start,
            end=first.end,
            max_length_tokens=max_length_tokens,
            model_hash=self.model_hash,
            route_rest=tuple(rest),
            timeout_s=self.step_timeout_s,
            wait_result=True,
            resend_tokens=tokens,
        )
        await self._step_and_wait(request, first, rest[-1])

    async def move(
        self,
        session_id: SessionID,
        stage: Stage,
        target: NodeID,
        timeout_s: float,
        part: LayerRange | None = None,
    ) -> tuple[int, int]:
        """Have ``stage``'s peer hand the session's cache (only ``part`` of its layers, if given: the peer keeps
        the session) over to ``target`` (rpc_move): the session's position, now held there, and the KV bytes
        sent. Any failure leaves the session on ``stage``."""
        layers = (part.start, part.end) if part is not None else None
        request = MoveRequest(session_id, str(target), self.maddrs(target), layers=layers)
        reply = await call_move(
            self.p2p, str(stage.peer_id), request, maddrs=self.maddrs(stage.peer_id), timeout_s=timeout_s
        )
        return reply.tokens, reply.kv_bytes

    async def run_alone(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor:
        """`stage` alone on `hidden` as a fresh session at position 0, closed after; the output in the dtype the
        peer computed it in (a spot-check compares answers at their own precision)."""
        hop = self._hops([stage])[0]
        session_id = SessionID(secrets.token_hex(16))
        request = StepRequest(
            session_id=session_id,
            position=0,
            hidden=hidden.to(self.wire_dtype),
            start=hop.start,
            end=hop.end,
            max_length_tokens=hidden.shape[0],
            model_hash=self.model_hash,
        )
        try:
            reply = await call_step(
                self.p2p, hop.peer_id, request, maddrs=hop.maddrs, timeout_s=self.step_timeout_s
            )
        finally:
            with contextlib.suppress(SwarmError, TimeoutError, ConnectionError, OSError):
                await self.close(session_id, [stage])  # best effort: it expires when idle anyway
        return reply.hidden

    async def aclose(self) -> None:
        """Stop the calls nobody awaits (late acknowledgements, releases) before the P2P instance goes."""
        pending: list[asyncio.Future[Any]] = [*self._acknowledging, *self._releasing]
        for call in pending:
            call.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def close(self, session_id: SessionID, stages: Sequence[Stage]) -> None:
        if not stages:
            return
        first, *rest = self._hops(stages)
        request = CloseRequest(session_id, tuple(rest))
        await call_close(
            self.p2p, first.peer_id, request, maddrs=first.maddrs, timeout_s=self.close_timeout_s
        )

    async def find_silent(self, stages: Sequence[Stage], timeout_s: float) -> NodeID | None:
        """The first stage whose peer does not answer a short info call, or None if all answer.

        When a whole step times out, nobody tells us which hop hung; asking each peer directly finds it, so
        the right peer is banned instead of the healthy first hop.
        """

        async def silent(stage: Stage) -> bool:
            try:
                await call_info(
                    self.p2p, str(stage.peer_id), maddrs=self.maddrs(stage.peer_id), timeout_s=timeout_s
                )
                return False
            except Exception as error:  # any failure to answer counts: we only want whom to blame
                logger.info("peer %s did not answer info: %s", str(stage.peer_id)[-8:], error)
                return True

        answers = await asyncio.gather(*(silent(s) for s in stages))
        return next((s.peer_id for s, dead in zip(stages, answers, strict=True) if dead), None)
