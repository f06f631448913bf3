"""The caller side of the peer RPCs: ``call_<verb>`` functions used by clients and by peers forwarding a step.

Every call has a deadline. A remote failure comes back as the same ``swarm.errors`` type it was raised with,
with ``failed_peer_id`` set to the peer that failed (the one called, or a hop further down its route), so the
caller knows whom to ban. Unreachable or silent peers raise ``TransportError``; malformed replies
``ProtocolError``.

    reply = await call_step(p2p, hop.peer_id, StepRequest(...), maddrs=hop.maddrs, timeout_s=30)
    reply.hidden            # [T, H] after the last hop of the route
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from hivemind.p2p import P2P

from swarm.errors import ProtocolError, SwarmError
from swarm.transport.channel import call_raw, decode_off_loop, encode_off_loop
from swarm.transport.linkprobe import LinkTiming, ProbeSizes, measure_both_ways
from swarm.wire import (
    MAX_FORWARDED_STEPS,
    CloseReply,
    CloseRequest,
    ErrorReply,
    HandoverReply,
    HandoverRequest,
    InfoReply,
    InfoRequest,
    MoveReply,
    MoveRequest,
    ProbeReply,
    ProbeRequest,
    Request,
    StepAck,
    StepBatch,
    StepBatchReply,
    StepReply,
    StepRequest,
    StepWait,
    StepWaits,
    decode_reply,
    encode_request,
)

DEFAULT_TIMEOUT_S = 30.0
_R = TypeVar("_R")


async def _call(
    p2p: P2P,
    peer_id: str,
    request: Request,
    expected: type[_R],
    *,
    maddrs: tuple[str, ...] | list[str],
    timeout_s: float,
    reply_bytes_hint: int = 0,
) -> _R:
    data = await encode_off_loop(encode_request, request)
    raw = await call_raw(
        p2p, peer_id, data, maddrs=maddrs, timeout_s=timeout_s, reply_bytes_hint=reply_bytes_hint
    )
    try:
        reply = await decode_off_loop(decode_reply, raw)
    except ProtocolError as e:
        e.failed_peer_id = peer_id
        raise
    return _answer(reply, expected, peer_id)


def _answer(reply: object, expected: type[_R], peer_id: str) -> _R:
    """``reply`` from ``peer_id`` as the ``expected`` answer; its ErrorReply, or an answer of the wrong kind, raised
    as an error with ``failed_peer_id`` set."""
    if isinstance(reply, ErrorReply):
        error = reply.to_error()
        error.failed_peer_id = reply.failed_peer_id or peer_id
        raise error
    if not isinstance(reply, expected):
        error = ProtocolError(f"peer {peer_id} answered {type(reply).__name__}, expected {expected.__name__}")
        error.failed_peer_id = peer_id
        raise error
    return reply


def _hidden_bytes(hidden: torch.Tensor) -> int:
    return hidden.numel() * hidden.element_size()


async def call_step(
    p2p: P2P,
    peer_id: str,
    request: StepRequest,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> StepReply:
    """Run one step of a session on ``peer_id`` and, through it, on every hop of ``request.route_rest``.

    The first step for a new ``session_id`` opens the session on each hop (with ``max_length_tokens``).
    Returns the last hop's hidden states and one HopTiming per hop. ``timeout_s`` covers the whole chain.
    Raises CapacityError (peer full), SessionError (unknown/expired session: reopen and replay),
    ModelMismatch, ProtocolError, TransportError.
    """
    return await _call(
        p2p,
        peer_id,
        request,
        StepReply,
        maddrs=maddrs,
        timeout_s=timeout_s,
        reply_bytes_hint=_hidden_bytes(request.hidden),
    )


async def call_step_acked(
    p2p: P2P,
    peer_id: str,
    request: StepRequest,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> StepAck:
    """Send a step with ``wait_result`` set; returns once every hop of the route has accepted it.

    The output then waits at the route's last hop for a ``call_wait``. Raises like call_step.
    """
    if not request.wait_result:
        raise ValueError("call_step_acked sends steps with wait_result set")
    return await _call(p2p, peer_id, request, StepAck, maddrs=maddrs, timeout_s=timeout_s)


def _outcomes(
    reply: StepBatchReply, expected: Sequence[type[_R]], peer_id: str, what: str
) -> list[_R | SwarmError]:
    """Each outcome of a batch reply as the answer expected of it, or the error it carries (``failed_peer_id``
    set); ProtocolError (raised) if the peer answered another number of outcomes than it was sent ``what``."""
    if len(reply.outcomes) != len(expected):
        error = ProtocolError(
            f"peer {peer_id} answered {len(reply.outcomes)} outcomes for {len(expected)} {what}"
        )
        error.failed_peer_id = peer_id
        raise error
    outcomes: list[_R | SwarmError] = []
    for outcome, kind in zip(reply.outcomes, expected, strict=True):
        try:
            outcomes.append(_answer(outcome, kind, peer_id))
        except SwarmError as e:
            outcomes.append(e)
    return outcomes


async def call_step_batch(
    p2p: P2P,
    peer_id: str,
    requests: list[StepRequest],
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[StepAck | StepReply | SwarmError]:
    """Send several steps to ``peer_id`` as one message; per step, what call_step (relayed) or call_step_acked
    (``wait_result``) would return, or the error it would raise (``failed_peer_id`` set). Raises like call_step
    when the message as a whole fails; ProtocolError also from a peer that does not know StepBatch (then send
    them one by one). Resends go alone."""
    if not requests or any(r.resend_tokens for r in requests):
        raise ValueError("call_step_batch sends one or more steps, and no resends")
    reply = await _call(
        p2p, peer_id, StepBatch(tuple(requests)), StepBatchReply, maddrs=maddrs, timeout_s=timeout_s
    )
    expected: list[type[StepAck | StepReply]] = [StepAck if r.wait_result else StepReply for r in requests]
    return _outcomes(reply, expected, peer_id, "steps")


async def call_wait_batch(
    p2p: P2P,
    peer_id: str,
    waits: list[StepWait],
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    reply_bytes_hint: int = 0,
) -> list[StepReply | SwarmError]:
    """Several waits at the same last hop ``peer_id`` as one message; per wait, what call_wait would return, or
    the error it would raise (``failed_peer_id`` set). Raises like call_wait when the message as a whole fails;
    ProtocolError also from a peer that does not know StepWaits (then wait for each alone)."""
    if not 1 <= len(waits) <= MAX_FORWARDED_STEPS:
        raise ValueError(f"call_wait_batch sends 1 to {MAX_FORWARDED_STEPS} waits")
    reply = await _call(
        p2p,
        peer_id,
        StepWaits(tuple(waits)),
        StepBatchReply,
        maddrs=maddrs,
        timeout_s=timeout_s,
        reply_bytes_hint=reply_bytes_hint,
    )
    return _outcomes(reply, [StepReply] * len(waits), peer_id, "waits")


async def call_wait(
    p2p: P2P,
    peer_id: str,
    request: StepWait,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    reply_bytes_hint: int = 0,
) -> StepReply:
    """The output of a ``wait_result`` step, from the last hop of its route (``peer_id``) once it is computed.

    Send it before (or with) the step itself: it waits there for the step to arrive. Raises like call_step,
    with ``failed_peer_id`` naming the last hop.
    """
    return await _call(
        p2p,
        peer_id,
        request,
        StepReply,
        maddrs=maddrs,
        timeout_s=timeout_s,
        reply_bytes_hint=reply_bytes_hint,
    )


async def call_close(
    p2p: P2P,
    peer_id: str,
    request: CloseRequest,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = 10.0,
) -> bool:
    """Close a session on ``peer_id`` and every hop of ``request.route_rest``; True if this peer knew it.

    Closing an unknown or expired session is not an error (returns False).
    """
    reply = await _call(p2p, peer_id, request, CloseReply, maddrs=maddrs, timeout_s=timeout_s)
    return reply.closed


async def call_handover(
    p2p: P2P,
    peer_id: str,
    request: HandoverRequest,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = 10.0,
) -> bool:
    """Send one chunk of a session's KV cache to ``peer_id``; True once the last chunk installed the session."""
    reply = await _call(p2p, peer_id, request, HandoverReply, maddrs=maddrs, timeout_s=timeout_s)
    return reply.installed


async def call_move(
    p2p: P2P,
    peer_id: str,
    request: MoveRequest,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = 60.0,
) -> MoveReply:
    """Ask ``peer_id`` to hand our session over to ``request.target_peer_id`` (swarm.peer.handover); the reply
    comes once the target installed it. A failure leaves the session where it was."""
    return await _call(p2p, peer_id, request, MoveReply, maddrs=maddrs, timeout_s=timeout_s)


async def call_info(
    p2p: P2P,
    peer_id: str,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = 10.0,
) -> InfoReply:
    """What ``peer_id`` serves right now: model, held range, free cache tokens, active sessions, version."""
    return await _call(p2p, peer_id, InfoRequest(), InfoReply, maddrs=maddrs, timeout_s=timeout_s)


async def call_probe(
    p2p: P2P,
    peer_id: str,
    request: ProbeRequest | None = None,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float = 10.0,
) -> ProbeReply:
    """Send a probe (empty by default: an RTT ping). See ProbeRequest for payloads and dial-back."""
    request = request or ProbeRequest()
    return await _call(
        p2p,
        peer_id,
        request,
        ProbeReply,
        maddrs=maddrs,
        timeout_s=timeout_s,
        reply_bytes_hint=request.reply_bytes,
    )


async def measure_link(
    p2p: P2P,
    peer_id: str,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    sizes: ProbeSizes | None = None,
    timeout_s: float = 10.0,
) -> LinkTiming:
    """RTT to ``peer_id`` and the bandwidth each way, by probes sized for the link (swarm.transport.linkprobe).

    Bandwidth is bytes / (probe time - rtt), so loopback gives large but finite numbers.
    """

    async def probe(sent: int, back: int) -> None:
        request = ProbeRequest(payload=bytes(sent), reply_bytes=back)
        await call_probe(p2p, peer_id, request, maddrs=maddrs, timeout_s=timeout_s)

    return await measure_both_ways(probe, sizes)
