"""Moving encoded messages between two hivemind P2P instances: unary calls for small ones, streams for big ones.

hivemind's unary calls ride one persistent connection to p2pd and are capped at 4 MiB per message (request or
reply, protobuf framing included), so anything near that goes over a fresh libp2p stream instead, framed as one
length-prefixed request and one length-prefixed reply. Both paths carry the same bytes (``swarm.wire``); this
module knows nothing about their meaning.

hivemind exposes unary calls on raw bytes only through ``P2P._client`` (the public API wants protobufs); this
module and ``swarm.dht`` are the only places that touch hivemind.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from contextlib import closing
from typing import TypeVar

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from swarm.errors import ProtocolError, TransportError
from swarm.wire import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

UNARY_PROTOCOL = "flowswarm.rpc"
STREAM_PROTOCOL = "flowswarm.rpc.stream"
# Requests or replies bigger than this go by stream: the unary cap is 4 MiB including protobuf framing.
UNARY_LIMIT_BYTES = 3 * 1024**2
_HEADER_BYTES = 8  # the length prefix hivemind uses for raw stream data (big-endian)

# Messages bigger than this are decoded on a worker thread: unpacking and checking a 200 MB tensor takes a
# while, and the event loop must keep serving meanwhile. Smaller ones are not worth a thread hop.
OFF_LOOP_BYTES = 1024**2

RawHandler = Callable[[bytes, str], Awaitable[bytes]]  # (request bytes, remote peer id) -> reply bytes
_T = TypeVar("_T")

# Peers this P2P instance has dialled with explicit multiaddrs, so we do not ask p2pd to connect on every call.
_dialled: weakref.WeakKeyDictionary[P2P, set[str]] = weakref.WeakKeyDictionary()


async def serve_raw(p2p: P2P, handler: RawHandler, *, read_timeout_s: float = 60.0) -> None:
    """Register ``handler`` for both unary calls and streams on ``p2p``. The handler must not raise."""

    async def on_unary(request: bytes, remote_id: PeerID) -> bytes:
        return await handler(request, remote_id.to_base58())

    async def on_stream(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = str(getattr(info, "peer_id", "?"))
        with closing(writer):
            try:
                async with asyncio.timeout(read_timeout_s):
                    request = await read_frame(reader)
            except (TimeoutError, ProtocolError, ConnectionError, asyncio.IncompleteReadError) as e:
                logger.info("dropped a stream from %s: %s", remote[-8:], e)
                return
            reply = await handler(request, remote)
            try:
                await P2P.send_raw_data(reply, writer)
            except (ConnectionError, OSError) as e:  # the caller went away; it will report its own timeout
                logger.debug("could not send a stream reply to %s: %s", remote[-8:], e)

    await p2p._client.add_unary_handler(UNARY_PROTOCOL, on_unary)
    await p2p.add_binary_stream_handler(STREAM_PROTOCOL, on_stream)


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One length-prefixed frame, refusing anything over MAX_MESSAGE_BYTES before allocating it."""
    header = await reader.readexactly(_HEADER_BYTES)
    length = int.from_bytes(header, "big")
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {length} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    return await reader.readexactly(length)


async def decode_off_loop(decode: Callable[[bytes], _T], data: bytes) -> _T:
    """``decode(data)``, on a worker thread when ``data`` is over OFF_LOOP_BYTES."""
    if len(data) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode, data)
    return decode(data)


async def ensure_connected(p2p: P2P, peer_id: str, maddrs: tuple[str, ...] | list[str]) -> None:
    """Tell p2pd where ``peer_id`` listens (once per peer), so calls to peers met only in the DHT work."""
    if not maddrs:
        return
    dialled = _dialled.setdefault(p2p, set())
    if peer_id in dialled:
        return
    await p2p._client.connect(PeerID.from_base58(peer_id), [Multiaddr(m) for m in maddrs])
    dialled.add(peer_id)


def forget_peer(p2p: P2P, peer_id: str) -> None:
    """After a failure, dial the peer again next time (it may have restarted on another port)."""
    _dialled.get(p2p, set()).discard(peer_id)


async def call_raw(
    p2p: P2P,
    peer_id: str,
    request: bytes,
    *,
    maddrs: tuple[str, ...] | list[str] = (),
    timeout_s: float,
    reply_bytes_hint: int = 0,
) -> bytes:
    """Send ``request`` to ``peer_id`` and return its reply bytes within ``timeout_s``.

    Goes by stream when the request or the expected reply (``reply_bytes_hint``) is past the unary limit.
    Raises TransportError (with ``failed_peer_id``) when the peer cannot be reached or does not answer in time.
    """
    try:
        target = PeerID.from_base58(peer_id)
    except Exception as e:
        raise ProtocolError(f"bad peer id {peer_id!r}: {e}") from None
    try:
        async with asyncio.timeout(timeout_s):
            await ensure_connected(p2p, peer_id, maddrs)
            if max(len(request), reply_bytes_hint) <= UNARY_LIMIT_BYTES:
                reply: bytes = await p2p._client.call_unary_handler(target, UNARY_PROTOCOL, request)
                return reply
            _, reader, writer = await p2p.call_binary_stream_handler(target, STREAM_PROTOCOL)
            with closing(writer):
                await P2P.send_raw_data(request, writer)
                return await read_frame(reader)
    except TimeoutError:
        forget_peer(p2p, peer_id)
        error = TransportError(f"peer {peer_id} did not answer within {timeout_s:.1f} s")
    except ProtocolError as e:
        e.failed_peer_id = peer_id
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # p2pd reports unreachable peers, resets and handler failures with several types
        forget_peer(p2p, peer_id)
        error = TransportError(f"peer {peer_id} is unreachable: {type(e).__name__}: {e}")
    error.failed_peer_id = peer_id
    raise error
