"""Long-lived libp2p streams: a call is one frame written on an open stream and one frame read back.

A message and its reply on a stream that is already open cost about half a hivemind unary call's round trip,
and less than opening a fresh stream per message (scripts/bench_wire.py; figures in docs/benchmarks.md). A
decode step crosses every hop of its route twice per token, so the open stream is what each hop uses.

The caller keeps, per P2P instance and remote peer, a few idle streams (``StreamPool``); a call takes one (or
opens one), writes its request, reads the reply and gives the stream back. A stream carries one call at a time,
so concurrent calls to the same peer use several streams and replies never need matching to requests. A stream
whose call failed or was cancelled half-way is closed, never reused: its next frame would be out of step.

The serving side (``serve_stream``) answers frames on a stream in order until the caller closes it, it stays
idle past ``STREAM_IDLE_S``, or a frame is malformed. The caller drops streams idle for ``POOL_IDLE_S`` (well
under the server's idle limit), so a pooled stream is almost never one the server has just closed; when one is
(its first read finds the stream already at its end before any reply byte), the call is retried once on a fresh
stream: the server closed it without reading our request, so the request has not run.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

from swarm.errors import ProtocolError
from swarm.wire import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

STREAM_PROTOCOL = "flowswarm.rpc.stream"
HEADER_BYTES = 8  # the length prefix hivemind uses for raw stream data (big-endian)
STREAM_IDLE_S = 120.0  # the server closes a stream that brings no request for this long
POOL_IDLE_S = 30.0  # the caller stops reusing a stream idle this long (well under STREAM_IDLE_S)
# Idle streams kept per remote peer; more concurrent calls open more, then close them. A client's sessions each
# keep a step and a wait in flight, and a peer forwards every session's step to the next hop: at 16 sessions a
# smaller cap kept closing and reopening streams, each open costing milliseconds (docs/benchmarks.md).
POOL_STREAMS_PER_PEER = 32  # under MAX_STREAMS_PER_REMOTE, so idle streams never crowd out calls
MAX_STREAMS_PER_REMOTE = 64  # open streams the server accepts from one remote peer at a time

RawHandler = Callable[[bytes, str], Awaitable[bytes]]  # (request bytes, remote peer id) -> reply bytes


class StaleStream(ConnectionError):
    """A pooled stream was found closed before any reply byte came back: safe to retry on a fresh one."""


async def read_frame(reader: asyncio.StreamReader, *, first: bool = False) -> bytes:
    """One length-prefixed frame, refusing anything over MAX_MESSAGE_BYTES before allocating it.

    With ``first``, a stream already at its end raises StaleStream instead of IncompleteReadError.
    """
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if first and not e.partial:
            raise StaleStream("the stream was closed before the reply") from None
        raise
    length = int.from_bytes(header, "big")
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {length} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    return await reader.readexactly(length)


async def send_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write ``data`` with its length prefix (what ``read_frame`` reads) in one write. hivemind's send_raw_data
    writes the 8-byte prefix on its own: a send of its own, and for the daemon a read of its own, on every frame
    (scripts/bench_wire.py measures both; docs/benchmarks.md)."""
    writer.writelines((len(data).to_bytes(HEADER_BYTES, "big"), data))
    await writer.drain()


@dataclass
class _Stream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0


class StreamPool:
    """Idle open streams of one P2P instance, per remote peer (see the module docstring)."""

    def __init__(self, p2p: P2P) -> None:
        self._p2p = weakref.ref(p2p)
        self._idle: dict[str, list[_Stream]] = {}

    def _take(self, peer_id: str) -> _Stream | None:
        idle = self._idle.get(peer_id, [])
        now = time.monotonic()
        while idle:
            stream = idle.pop()  # the most recently used: the least likely to have been closed
            if now - stream.idle_since < POOL_IDLE_S and not stream.writer.is_closing():
                return stream
            stream.writer.close()
        return None

    def _give_back(self, peer_id: str, stream: _Stream) -> None:
        idle = self._idle.setdefault(peer_id, [])
        if len(idle) >= POOL_STREAMS_PER_PEER:
            stream.writer.close()
            return
        stream.idle_since = time.monotonic()
        idle.append(stream)

    def forget(self, peer_id: str) -> None:
        """Close every idle stream to ``peer_id`` (after a failure: it may have restarted elsewhere)."""
        for stream in self._idle.pop(peer_id, []):
            stream.writer.close()

    async def _open(self, target: PeerID) -> _Stream:
        p2p = self._p2p()
        if p2p is None:
            raise ConnectionError("this P2P instance has shut down")
        _, reader, writer = await p2p.call_binary_stream_handler(target, STREAM_PROTOCOL)
        return _Stream(reader, writer)

    async def call(self, peer_id: str, target: PeerID, request: bytes) -> bytes:
        """Send ``request`` on a pooled (or new) stream to ``target`` and return the reply frame."""
        pooled = self._take(peer_id)
        if pooled is not None:
            try:
                return await self._exchange(peer_id, pooled, request)
            except StaleStream:
                logger.debug("a pooled stream to %s had been closed; opening a fresh one", peer_id[-8:])
        return await self._exchange(peer_id, await self._open(target), request)

    async def _exchange(self, peer_id: str, stream: _Stream, request: bytes) -> bytes:
        done = False
        try:
            try:
                await send_frame(stream.writer, request)
            except (ConnectionError, OSError) as e:  # the frame did not get through whole: nothing ran
                raise StaleStream(f"could not write on the stream: {e}") from None
            reply = await read_frame(stream.reader, first=True)
            done = True
            return reply
        finally:  # a stream left half-way (error, cancellation) is out of step: never reuse it
            if done:
                self._give_back(peer_id, stream)
            else:
                stream.writer.close()


_pools: weakref.WeakKeyDictionary[P2P, StreamPool] = weakref.WeakKeyDictionary()


def pool_for(p2p: P2P) -> StreamPool:
    pool = _pools.get(p2p)
    if pool is None:
        pool = _pools[p2p] = StreamPool(p2p)
    return pool


async def serve_stream(
    handler: RawHandler, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answer the frames of one stream in order until it ends, idles past STREAM_IDLE_S, or breaks."""
    with closing(writer):
        while True:
            try:
                async with asyncio.timeout(STREAM_IDLE_S):
                    request = await read_frame(reader)
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    logger.info("a stream from %s ended inside a frame", remote[-8:])
                return  # else the caller closed it between two calls: the normal end
            except (TimeoutError, ProtocolError, ConnectionError) as e:
                logger.info("dropped a stream from %s: %s", remote[-8:], e)
                return
            reply = await handler(request, remote)
            try:
                await send_frame(writer, reply)
            except (ConnectionError, OSError) as e:  # the caller went away; it will report its own timeout
                logger.debug("could not send a stream reply to %s: %s", remote[-8:], e)
                return
