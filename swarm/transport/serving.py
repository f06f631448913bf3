"""The receiving side: decode a request, hand it to the matching ``rpc_<verb>`` method, encode what it returns.

Nothing a remote sends can crash the peer: undecodable input becomes an ErrorReply with the ProtocolError's
message, a SwarmError raised by a handler keeps its code, and any other exception is logged and reported as a
plain SwarmError naming this peer.
"""

from __future__ import annotations

import logging
from typing import Protocol

from hivemind.p2p import P2P

from swarm.errors import SwarmError
from swarm.transport.channel import decode_off_loop, encode_off_loop, serve_raw
from swarm.wire import (
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
    Reply,
    StepAck,
    StepBatch,
    StepBatchReply,
    StepReply,
    StepRequest,
    StepWait,
    StepWaits,
    decode_request,
    encode_reply,
    request_verb,
)

logger = logging.getLogger(__name__)


class RpcHandler(Protocol):
    """What a peer implements to serve requests (see swarm.peer.handlers)."""

    @property
    def peer_id(self) -> str: ...

    async def rpc_step(self, request: StepRequest, remote_id: str) -> StepReply | StepAck: ...

    async def rpc_steps(self, request: StepBatch, remote_id: str) -> StepBatchReply: ...

    async def rpc_wait(self, request: StepWait, remote_id: str) -> StepReply: ...

    async def rpc_waits(self, request: StepWaits, remote_id: str) -> StepBatchReply: ...

    async def rpc_close(self, request: CloseRequest, remote_id: str) -> CloseReply: ...

    async def rpc_info(self, request: InfoRequest, remote_id: str) -> InfoReply: ...

    async def rpc_probe(self, request: ProbeRequest, remote_id: str) -> ProbeReply: ...

    async def rpc_handover(self, request: HandoverRequest, remote_id: str) -> HandoverReply: ...

    async def rpc_move(self, request: MoveRequest, remote_id: str) -> MoveReply: ...


def error_reply(error: Exception, peer_id: str, remote_id: str) -> ErrorReply:
    """What a request from ``remote_id`` that failed here with ``error`` is answered: a SwarmError keeps its
    code; anything else is a bug here, logged with its traceback and reported as a plain SwarmError."""
    if isinstance(error, SwarmError):
        logger.info("request from %s failed: %s: %s", remote_id[-8:], error.code, error)
    else:  # a bug in a handler must not take the peer down; report it, keep serving
        logger.error("handler failed on a request from %s", remote_id[-8:], exc_info=error)
    return ErrorReply.from_error(error, peer_id)


async def dispatch(handler: RpcHandler, data: bytes, remote_id: str) -> bytes:
    """Decode, call ``handler.rpc_<verb>``, encode; every failure becomes an encoded ErrorReply."""
    reply: Reply
    try:
        request = await decode_off_loop(decode_request, data)
        method = getattr(handler, f"rpc_{request_verb(request)}")
        reply = await method(request, remote_id)
    except Exception as e:
        reply = error_reply(e, handler.peer_id, remote_id)
    try:
        return await encode_off_loop(encode_reply, reply)
    except SwarmError as e:  # e.g. a reply tensor in a dtype the wire does not carry
        return encode_reply(ErrorReply.from_error(e, handler.peer_id))


async def serve(p2p: P2P, handler: RpcHandler) -> None:
    """Start answering requests to ``p2p`` with ``handler`` (unary calls and streams alike)."""

    async def on_request(data: bytes, remote_id: str) -> bytes:
        return await dispatch(handler, data, remote_id)

    await serve_raw(p2p, on_request)
