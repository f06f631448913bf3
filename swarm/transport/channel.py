"""Moving encoded messages between two hivemind P2P instances over long-lived libp2p streams.

Every call goes as one length-prefixed request and one length-prefixed reply on a stream kept open between
calls (``swarm.transport.streams``: half the round trip of a hivemind unary call, and no 4 MiB cap). Peers still
answer unary calls too, for callers of earlier releases. Both paths carry the same bytes (``swarm.wire``); this
module knows nothing about their meaning.

hivemind exposes unary calls on raw bytes only through ``P2P._client`` (the public API wants protobufs); this
module and ``swarm.dht`` are the only places that touch hivemind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from swarm.errors import ProtocolError, TransportError
from swarm.transport.streams import (
    MAX_STREAMS_PER_REMOTE,
    STREAM_PROTOCOL,
    RawHandler,
    pool_for,
    serve_stream,
)

logger = logging.getLogger(__name__)

UNARY_PROTOCOL = "flowswarm.rpc"  # answered for callers of earlier releases; this one calls by stream only

# Messages bigger than this are decoded on a worker thread: unpacking and checking a 200 MB tensor takes a
# while, and the event loop must keep serving meanwhile. Smaller ones are not worth a thread hop.
OFF_LOOP_BYTES = 1024**2

_T = TypeVar("_T")
_M = TypeVar("_M")

# Peers this P2P instance has dialled with explicit multiaddrs, so we do not ask p2pd to connect on every call.
_dialled: weakref.WeakKeyDictionary[P2P, set[str]] = weakref.WeakKeyDictionary()


async def serve_raw(p2p: P2P, handler: RawHandler) -> None:
    """Register ``handler`` for both unary calls and streams on ``p2p``. The handler must not raise."""
    open_streams: Counter[str] = Counter()  # per remote peer, so one remote cannot hold all our sockets

    async def on_unary(request: bytes, remote_id: PeerID) -> bytes:
        return await handler(request, remote_id.to_base58())

    async def on_stream(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = str(getattr(info, "peer_id", "?"))
        if open_streams[remote] >= MAX_STREAMS_PER_REMOTE:
            logger.info("refused a stream from %s: %d already open", remote[-8:], open_streams[remote])
            writer.close()
            return
        open_streams[remote] += 1
        try:
            await serve_stream(handler, remote, reader, writer)
        finally:
            open_streams[remote] -= 1
            if not open_streams[remote]:
                del open_streams[remote]

    await p2p._client.add_unary_handler(UNARY_PROTOCOL, on_unary)
    await p2p.add_binary_stream_handler(STREAM_PROTOCOL, on_stream)


async def encode_off_loop(encode: Callable[[_M], bytes], message: _M) -> bytes:
    """``encode(message)``, on a worker thread when its hidden states are over OFF_LOOP_BYTES (a lighter codec
    quantizes them as it encodes: work the event loop should not wait on)."""
    hidden = getattr(message, "hidden", None)
    if isinstance(hidden, torch.Tensor) and hidden.numel() * hidden.element_size() > OFF_LOOP_BYTES:
        return await asyncio.to_thread(encode, message)
    return encode(message)


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
    pool_for(p2p).forget(peer_id)


@functools.lru_cache(maxsize=4096)
def _parse_peer_id(peer_id: str) -> PeerID:
    # base58 decoding is pure Python (tens of microseconds), and a peer calls the same few peers every step
    return PeerID.from_base58(peer_id)


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

    ``reply_bytes_hint`` is kept for callers; every size now goes by stream. Raises TransportError (with ``failed_peer_id``) when the peer cannot be reached or does not answer in time.
    """
    try:
        target = _parse_peer_id(peer_id)
    except Exception as e:
        raise ProtocolError(f"bad peer id {peer_id!r}: {e}") from None
    try:
        async with asyncio.timeout(timeout_s):
            await ensure_connected(p2p, peer_id, maddrs)
            return await pool_for(p2p).call(peer_id, target, request)
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
