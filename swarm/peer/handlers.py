"""The peer's rpc_* handlers: check a request, run it through the Peer (which owns sessions and ranges), forward.

A step carries the rest of its route. This peer computes its layers on the executor thread and pushes the
output straight to the next hop with call_step (which does the same), so the client sends one request per
token. When the next hop fails, the error that comes back names it (``failed_peer_id``), so the client knows
whom to ban. Without ``wait_result`` the last hop's output travels back up the chain. With it (the client's
default for routes of two hops or more), the last hop acknowledges the step once accepted and gives its output
to the client's StepWait (``rpc_wait``, see swarm.peer.handoff); each hop answers its caller with a StepAck as
soon as the next hop has, so the acks travel back while the last hop computes and no relay is on the path of
the output. A failure after the last hop accepted the step reaches the client through its wait. The decode
steps of one executor batch bound for the same remaining route leave as one message (``rpc_steps`` at the next
hop, see swarm.peer.forwarding), each with its own outcome.

Sessions open implicitly on their first step and close on rpc_close, on idle timeout or past their lifetime
(the reaper), or when the peer leaves (``Peer.drain``). A session is known by its id and its client (``origin``,
authenticated by the route's first hop and passed down the route; ``session_key``), so it survives a change of
the hop before us (a failover, a hand-over), and it counts against the share of the remote peer that opened it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from hivemind.p2p import P2P

from swarm.codec import choose_codec
from swarm.dht.traffic import TrafficMeter
from swarm.errors import CapacityError, ProtocolError, SessionError, SwarmError
from swarm.models.blocks import Step
from swarm.models.faults import OutputFaults
from swarm.models.spec import dtype_name
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Group, StepResult
from swarm.peer.forwarding import Forwarder
from swarm.peer.handoff import Handoff, Parked
from swarm.peer.handover import Handovers
from swarm.peer.reach import DialBack
from swarm.peer.state import Peer, Served, session_key
from swarm.transport.calls import call_close, call_step, call_step_acked, call_step_batch
from swarm.transport.serving import error_reply
from swarm.types import LayerRange
from swarm.wire import (
    CloseReply,
    CloseRequest,
    ErrorReply,
    HandoverReply,
    HandoverRequest,
    Hop,
    HopTiming,
    InfoReply,
    InfoRequest,
    MoveReply,
    MoveRequest,
    ProbeReply,
    ProbeRequest,
    StepAck,
    StepBatch,
    StepBatchReply,
    StepReply,
    StepRequest,
    StepWait,
    StepWaits,
)

logger = logging.getLogger(__name__)

MAX_CODECS_KEPT = 1024  # next hops whose codec we remember (to log each change once)

DIAL_BACK_FAILED = "could not dial you back at the addresses you gave"  # the only failure a probe reports


class PeerHandlers:
    """Implements swarm.transport.RpcHandler for ``peer``."""

    def __init__(
        self,
        peer: Peer,
        p2p: P2P,
        config: SessionConfig | None = None,
        faults: OutputFaults | None = None,
        on_probe: Callable[[str], None] = lambda remote_id: None,
    ) -> None:
        self.peer = peer
        self.on_probe = on_probe  # told who probes our links (swarm.peer.measure.LinkMonitor.heard_probe)
        self.p2p = p2p
        self.config = config or SessionConfig()
        self.in_flight: Counter[str] = Counter()  # steps being served, per remote peer
        self.faults = (
            faults  # TEST ONLY (--faulty-output/skip-rate): lies on some steps, for spot-check tests
        )
        # wait_result steps meet their clients' waits here (when we are the last hop of their route)
        self.handoff = Handoff()
        self.handover = Handovers(peer, p2p)  # sessions moved to, or from, another peer (swarm.peer.handover)
        # wait_result steps on to their next hop, a batch's steps for one peer in one message
        self.forwarder = Forwarder(self._send_step, self._send_steps)
        self.codecs: dict[str, str] = {}  # the codec our output last took to each next hop (swarm.codec)
        # others' reachability checks: dialled from a node of its own (swarm.peer.reach); close with aclose()
        self.dial_back = DialBack(self.config.dial_back_timeout_s)
        self.traffic: TrafficMeter | None = None  # the peer's background traffic, reported by rpc_info

    async def aclose(self) -> None:
        """Stop what the handlers started (the dial-back node)."""
        await self.dial_back.aclose()

    @contextlib.contextmanager
    def _admit(self, remote_id: str) -> Iterator[None]:
        """Count a step of ``remote_id`` in flight; CapacityError past its share (no one remote floods us)."""
        if self.in_flight[remote_id] >= self.config.max_requests_per_remote:
            raise CapacityError(
                f"{self.in_flight[remote_id]} requests of yours are already in flight here, the limit"
            )
        self.in_flight[remote_id] += 1
        try:
            yield
        finally:
            self.in_flight[remote_id] -= 1
            if not self.in_flight[remote_id]:
                del self.in_flight[remote_id]

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    async def rpc_step(self, request: StepRequest, remote_id: str) -> StepReply | StepAck:
        with self._admit(remote_id):
            try:
                async with asyncio.timeout(request.timeout_s):  # the caller's deadline bounds our work
                    return await self._step(request, remote_id)
            except TimeoutError:
                raise CapacityError(f"the step's {request.timeout_s:.1f} s deadline passed here") from None

    async def rpc_steps(self, request: StepBatch, remote_id: str) -> StepBatchReply:
        """Steps the hop before us forwarded together (swarm.peer.forwarding): each runs as its own rpc_step,
        and fails alone. The reply waits for the slowest; which steps share it is the sender's choice (ours
        sends together only decode steps on the same remaining route), so a slow step delays only the steps its
        own sender put with it."""

        async def one(step: StepRequest) -> StepAck | StepReply | ErrorReply:
            try:
                if step.resend_tokens:
                    raise ProtocolError("a resend goes alone, not in a forwarded batch")
                return await self.rpc_step(step, remote_id)
            except Exception as e:  # fails its own step only; the others and the peer go on
                return error_reply(e, self.peer_id, remote_id)

        return StepBatchReply(tuple(await asyncio.gather(*(one(step) for step in request.steps))))

    async def _send_step(self, hop: Hop, request: StepRequest, timeout_s: float) -> StepAck | StepReply:
        if request.wait_result:
            return await call_step_acked(
                self.p2p, hop.peer_id, request, maddrs=hop.maddrs, timeout_s=timeout_s
            )
        return await call_step(self.p2p, hop.peer_id, request, maddrs=hop.maddrs, timeout_s=timeout_s)

    async def _send_steps(
        self, hop: Hop, requests: list[StepRequest], timeout_s: float
    ) -> list[StepAck | StepReply | SwarmError]:
        return await call_step_batch(self.p2p, hop.peer_id, requests, maddrs=hop.maddrs, timeout_s=timeout_s)

    async def _step(self, request: StepRequest, remote_id: str) -> StepReply | StepAck:
        received = time.perf_counter()
        deadline = received + request.timeout_s
        layers = LayerRange(request.start, request.end)
        self.peer.check_request(request.model_hash, layers, int(request.hidden.shape[-1]))
        self.peer.check_route(layers, request.route_rest)
        await self.peer.check_live(request.route_rest)
        origin = request.origin or remote_id  # empty from the client itself, the first hop
        key = session_key(origin, request.session_id)
        self.handover.check_moved(key)
        if request.resend_tokens:
            return await self._resend(request, key, origin, deadline, received)
        served = await self.peer.session_for(
            key, remote_id, layers, request.position, request.max_length_tokens
        )
        step = Step(key, request.hidden.to(served.blocks.dtype), request.start, request.end, request.position)
        # keyed by who sent it: a client's round, or the steps one forward call of the hop before sent here
        group = (f"{remote_id}/{request.batch_id}", request.batch_size) if request.batch_size > 1 else None
        if request.wait_result and not request.route_rest:  # the last hop: the client's wait computes it
            parked = Parked(served, step, deadline, received, group)
            self.handoff.park(request.session_id, request.position, parked)
            return StepAck(
                (_finish(HopTiming(self.peer_id, request.start, request.end, 0.0, 0.0, 0.0), received),)
            )
        onward = request.route_rest[0].peer_id if request.route_rest else ""
        started_s = self.peer.clock()
        result = await self._compute(served, step, group, onward, paced=not request.origin)
        timing = HopTiming(self.peer_id, request.start, request.end, result.queue_s, result.compute_s, 0.0)
        if not request.route_rest:
            return StepReply(result.hidden, (_finish(timing, received),))
        if self.peer.closed_since(key, started_s):  # its close went on meanwhile: the step must not follow it
            raise SessionError(f"session {key[:16]} was closed by its client while this step ran here")
        # TEST ONLY: lie about the hops after us. Only a relayed step can: a wait_result step's output goes from
        # the last hop to the client, so a middle hop cannot answer for the hops after it.
        if self.faults is not None and not request.wait_result and self.faults.skip_forward():
            return StepReply(
                result.hidden, (_finish(timing, received), *self.faults.fake_timings(request.route_rest))
            )
        hop, rest = request.route_rest[0], request.route_rest[1:]
        downstream = replace(
            request,
            hidden=result.hidden,
            start=hop.start,
            end=hop.end,
            route_rest=rest,
            timeout_s=max(1e-3, deadline - time.perf_counter()),  # what is left of the caller's deadline
            origin=origin,
            codec=self._codec_to(hop, request, served.blocks.dtype),
        )
        # the next hop waits for the steps this forward call computed for it (none: it goes alone), not for the
        # group this step came in: some of that may have run apart here, or go on to other hops
        batch_id, batch_size = result.onward_group or ("", 1)
        downstream = replace(downstream, batch_id=batch_id, batch_size=batch_size)
        timeout_s = min(self.config.forward_timeout_s, downstream.timeout_s)
        answer = await self.forwarder.forward(hop, downstream, timeout_s)
        if isinstance(answer, StepAck):  # a wait_result step: its output goes to the client's wait
            return StepAck((_finish(timing, received), *answer.timings))
        return StepReply(answer.hidden, (_finish(timing, received), *answer.timings))

    def _codec_to(self, hop: Hop, request: StepRequest, dtype: torch.dtype) -> str:
        """How our output travels to ``hop`` (swarm.codec): exact for a lossless step, else as configured; auto
        weighs our measured link to it against the hop's compute (our own speed per layer stands for its)."""
        if request.lossless:
            return "exact"
        activations = self.config.activations
        link = self.peer.links.get(hop.peer_id)
        speed = self.peer.compute.prefill_layer_tokens_s
        bandwidth = link.bandwidth_bytes_s if link is not None else None
        codec = choose_codec(
            activations.mode,
            dtype,
            self.peer.spec.hidden_size,
            bandwidth,
            (hop.end - hop.start) / speed if speed > 0 else None,
            activations.auto_fraction,
        )
        if self.codecs.get(hop.peer_id) != codec:
            if len(self.codecs) >= MAX_CODECS_KEPT:  # the next hops are the clients' choice: bounded
                self.codecs.clear()
            self.codecs[hop.peer_id] = codec
            measured = f"{bandwidth / 1e6:.1f} MB/s" if bandwidth else "not measured"
            logger.info("hidden states to %s go as %s (link %s)", hop.peer_id[-8:], codec, measured)
        return codec

    async def _compute(
        self, served: Served, step: Step, group: Group | None = None, onward: str = "", paced: bool = True
    ) -> StepResult:
        key = step.session_id or ""
        session = served.sessions.get(key)  # everything this peer keeps of it (swarm/peer/session.py)
        steps = session.steps if session is not None else None
        try:
            async with self.handover.step(key, session):  # waits while the session is handed over
                result = await self.peer.executor.forward(served.blocks, step, group, onward, paced, steps)
        finally:
            self.peer.touch(step.session_id or "")
        if self.faults is not None:
            result = replace(result, hidden=self.faults.corrupt(result.hidden))
        _log_sent(served, step, result, self.peer.spec.num_layers)
        return result

    async def _resend(
        self, request: StepRequest, key: str, origin: str, deadline: float, received: float
    ) -> StepAck:
        """Send session ``key``'s logged outputs [position, +resend_tokens) on to ``request.route_rest`` as a
        step (no compute here): a failover refilling the stages it replaced (swarm.peer.outputs). Only the
        client may ask (``key`` is its own), and only with ``wait_result``: the output goes to its wait."""
        served = self.peer.find(key)
        if served is None:
            raise SessionError(f"no session {key[:16]} here to resend from: replay from the tokens")
        if not request.wait_result:
            raise ProtocolError("a resend must be sent with wait_result")
        hidden = served.sessions[key].sent.read(request.position, request.resend_tokens, request.end)
        self.peer.touch(key)
        hop, rest = request.route_rest[0], request.route_rest[1:]
        downstream = replace(
            request,
            hidden=hidden,
            start=hop.start,
            end=hop.end,
            route_rest=rest,
            timeout_s=max(1e-3, deadline - time.perf_counter()),
            origin=origin,
            resend_tokens=0,
            codec=self._codec_to(hop, request, served.blocks.dtype),
        )
        timeout_s = min(self.config.forward_timeout_s, downstream.timeout_s)
        ack = await call_step_acked(self.p2p, hop.peer_id, downstream, maddrs=hop.maddrs, timeout_s=timeout_s)
        timing = HopTiming(self.peer_id, request.start, request.end, 0.0, 0.0, 0.0)
        return StepAck((_finish(timing, received), *ack.timings))

    async def rpc_wait(self, request: StepWait, remote_id: str) -> StepReply:
        """The output of a ``wait_result`` step for which we are the last hop, computed once it arrives.

        Whoever knows the session id may wait (the client's secret, shared only with its route's hops); the
        step itself runs under the session of the hop that sent it, as any step does.
        """
        with self._admit(remote_id):
            try:
                async with asyncio.timeout(request.timeout_s):
                    parked = await self.handoff.take(request.session_id, request.position)
                    async with asyncio.timeout(max(1e-3, parked.deadline - time.perf_counter())):
                        # parked: the last hop of a longer route, so the hop before sent it (not paced here)
                        result = await self._compute(parked.served, parked.step, parked.group, paced=False)
            except TimeoutError:
                raise CapacityError(f"the step's {request.timeout_s:.1f} s deadline passed here") from None
        step = parked.step
        timing = HopTiming(self.peer_id, step.start, step.end, result.queue_s, result.compute_s, 0.0)
        return StepReply(result.hidden, (_finish(timing, parked.received),), request.codec)

    async def rpc_waits(self, request: StepWaits, remote_id: str) -> StepBatchReply:
        """A client round's waits for outputs here, in one message: each runs as its own ``rpc_wait`` and fails
        alone; the reply waits for the slowest (the client sends together waits for steps it sent together)."""

        async def one(wait: StepWait) -> StepReply | ErrorReply:
            try:
                return await self.rpc_wait(wait, remote_id)
            except Exception as e:  # fails its own wait only; the others and the peer go on
                return error_reply(e, self.peer_id, remote_id)

        return StepBatchReply(tuple(await asyncio.gather(*(one(wait) for wait in request.waits))))

    async def rpc_close(self, request: CloseRequest, remote_id: str) -> CloseReply:
        origin = request.origin or remote_id
        closed = await self.peer.close_for_client(session_key(origin, request.session_id))
        # Passed on only when it closed something here: forwarding a close for a session we never saw would
        # let anyone send closes down a route in our name.
        if closed and request.route_rest:
            hop = request.route_rest[0]
            try:
                await call_close(
                    self.p2p,
                    hop.peer_id,
                    CloseRequest(request.session_id, request.route_rest[1:], origin),
                    maddrs=hop.maddrs,
                    timeout_s=self.config.close_timeout_s,
                )
            except Exception as e:  # best effort: the next hop frees the session on idle timeout anyway
                logger.info("could not close session on %s: %s", hop.peer_id[-8:], e)
        return CloseReply(closed)

    async def rpc_handover(self, request: HandoverRequest, remote_id: str) -> HandoverReply:
        """A chunk of a session a leaving peer, or one asked by its client (rpc_move), hands us (see
        swarm.peer.handover)."""
        with self._admit(remote_id):
            return await self.handover.install(request, remote_id)

    async def rpc_move(self, request: MoveRequest, remote_id: str) -> MoveReply:
        """Hand the caller's session to the peer it names (see swarm.peer.handover): a client moving its session
        from the prefill route to its decode route. The session is looked up under the caller's own id, so
        nobody else can move it; the target checks that it holds the session's layers and has room."""
        if request.origin and request.origin != remote_id:
            raise ProtocolError("only a session's own client may move it: origin is not the caller")
        key = session_key(remote_id, request.session_id)
        self.handover.check_moved(key)
        served = self.peer.find(key)
        if served is None:
            raise SessionError(f"no session {key[:16]} of yours here to move")
        with self._admit(remote_id):
            part = LayerRange(*request.layers) if request.layers is not None else None
            tokens, kv_bytes = await self.handover.move(
                served, key, request.target_peer_id, request.target_maddrs, part
            )
        return MoveReply(tokens, kv_bytes)

    async def rpc_info(self, request: InfoRequest, remote_id: str) -> InfoReply:
        peer, spec = self.peer, self.peer.spec
        held = peer.held or LayerRange(0, 0)
        current = peer.current
        return InfoReply(
            peer_id=peer.peer_id,
            name=peer.identity.name,
            model_name=spec.name,
            model_hash=spec.weights_hash,
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            dtype=dtype_name(current.blocks.dtype) if current is not None else "",
            range_start=held.start,
            range_end=held.end,
            cache_tokens_total=peer.cache_tokens_total,
            free_cache_tokens=peer.free_cache_tokens,
            active_sessions=peer.session_count,
            state=str(peer.status),
            background_bytes=self.traffic.triples() if self.traffic is not None else (),
            cache=peer.cache_stats,
        )

    async def rpc_probe(self, request: ProbeRequest, remote_id: str) -> ProbeReply:
        """Echo sizes, send ``reply_bytes`` back (capped), and dial the caller back if it asks.

        Dial-back goes only to the caller itself and reports a bare yes/no: echoing dial errors to anyone, for
        any address, would make every peer a port scanner; large replies would make it a traffic amplifier.
        """
        limit = self.config.max_probe_reply_bytes
        if request.reply_bytes > limit:
            raise ProtocolError(
                f"probe asks for {request.reply_bytes} bytes back, this peer sends at most {limit}"
            )
        ok: bool | None = None
        error = ""
        with self._admit(remote_id):  # probes count against the caller's share too: no flood of replies
            if request.dial_back_peer_id:
                if request.dial_back_peer_id != remote_id:
                    raise ProtocolError("dial-back is only to the peer that asks for it")
                ok = await self.dial_back(remote_id, request.dial_back_maddrs)
                error = "" if ok else DIAL_BACK_FAILED
            elif request.payload or request.reply_bytes:  # a bandwidth probe, not a ping
                self.on_probe(remote_id)
            return ProbeReply(self.peer_id, len(request.payload), bytes(request.reply_bytes), ok, error)


async def reap_idle_sessions(peer: Peer, interval_s: float) -> None:
    """Close idle sessions every ``interval_s`` until cancelled; one failed round does not stop the next."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await peer.reap()
        except Exception as e:  # e.g. the executor queue is full: the sessions are still idle next round
            logger.warning("reaping idle sessions failed (retrying in %.0f s): %r", interval_s, e)


def _log_sent(served: Served, step: Step, result: StepResult, num_layers: int) -> None:
    """Log what a step of a session sends on to the next hop (not the model's last layers: those go to the
    client), so a failover after us can ask us to resend it (swarm.peer.outputs)."""
    session = served.sessions.get(step.session_id or "")
    if session is not None and step.end < num_layers:
        session.sent.record(step.position, step.end, result.hidden)


def _finish(timing: HopTiming, received: float) -> HopTiming:
    total = time.perf_counter() - received
    return HopTiming(timing.peer_id, timing.start, timing.end, timing.queue_s, timing.compute_s, total)
