"""Hand-over: a peer that leaves (SIGTERM) or drops a range sends its open sessions' KV caches to a successor.

Sender (``Handovers.hand_over``): freeze the session (new steps wait, the in-flight one finishes), read its
cache for positions [0, P) of the layers it uses, send it as chunks (``HandoverRequest``, at most
``CHUNK_BYTES`` each, in order) to the successor, which installs it under the same key (session id @ origin).
From then on a step of it here gets ``SessionMoved`` naming the successor, and the client steps there at the
same position. If anything fails the session is unfrozen and stays here (closed at the end of the drain, so
its client replays, as without hand-over).

A client may also name the successor itself (``Handovers.move``, from rpc_move): a session prefilled on one
route moves to the peers of its decode route after its prompt. The same freeze, chunks and checks apply; the
target refuses what it cannot take, and the session then stays here.

Successor choice (``pick_successor``): a serving peer of the latest DHT read, not us, whose range covers the
session's layers and with free cache for its reservation; the most free cache wins (the plan gives every
range its replicas, and the emptiest one is the least likely to refuse or to be the plan's next move).

Receiver (``Handovers.install``): the first chunk opens the session as any first step would, counted against
the sender's share and refused past the caps (CapacityError); each chunk is checked against the model's
shapes and dtype and against the chunk expected next, so a hostile sender can write at most the cache the
session reserved, and a half-sent session expires like an idle one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from swarm.dht import PeerRecord
from swarm.errors import ProtocolError, SessionError, SessionMoved
from swarm.models.blocks import BlockRange
from swarm.peer.session import Incoming, Session
from swarm.peer.state import Peer, Served, Status, session_key
from swarm.transport.calls import call_handover
from swarm.types import LayerRange
from swarm.wire import HandoverReply, HandoverRequest

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # keys + values of one chunk: well under the 4 MiB a unary message may carry
CHUNK_TIMEOUT_S = 10.0
HANDOVER_LINGER_S = 5.0  # a leaving peer waits up to this for each moved session's client to step (and learn)


@dataclass(frozen=True)
class Snapshot:
    """A session's cache as read on the torch thread: per used layer, keys and values [kv_heads, P, head_dim]."""

    key: str
    max_length_tokens: int
    layers: LayerRange  # the layers read
    position: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    held: LayerRange  # all the layers the session holds here


class Handovers:
    """Both sides of hand-over for one peer: freezing and moving its sessions, installing others'. A session's
    own hand-over state is on its Session (swarm/peer/session.py); here are only the sessions gone from here."""

    def __init__(self, peer: Peer, p2p: P2P) -> None:
        self.peer = peer
        self.p2p = p2p
        # sessions handed over, no longer here: key -> (successor peer id, when). A client steps within the idle
        # timeout or its session would have expired here anyway, so each is kept that long.
        self.moved: dict[str, tuple[str, float]] = {}
        self._idle = asyncio.Condition()
        self._told: set[str] = set()  # moved sessions whose step got SessionMoved
        self._all_told = asyncio.Event()

    # ------------------------------------------------------------------ sender

    def check_moved(self, key: str) -> None:
        """SessionMoved if session ``key`` was handed over (before looking it up: it is closed here)."""
        moved = self.moved.get(key)
        if moved is not None:
            self._told.add(key)
            if self._told >= set(self.moved):
                self._all_told.set()
            raise SessionMoved(f"session {key[:16]} moved to {moved[0][-8:]}", moved[0])

    @asynccontextmanager
    async def step(self, key: str, session: Session | None) -> AsyncIterator[None]:
        """Around a step's compute of session ``key`` (``session``, if still open here): waits while the session
        is frozen, SessionMoved once it has moved."""
        if session is not None and session.handover.frozen is not None:
            await asyncio.shield(session.handover.frozen)
        self.check_moved(key)
        if session is None:
            yield
            return
        state = session.handover
        state.in_flight += 1
        try:
            yield
        finally:
            state.in_flight -= 1
            if (
                not state.in_flight and state.frozen is not None
            ):  # a hand-over waits for its steps to end (rare)
                async with self._idle:
                    self._idle.notify_all()

    async def hand_over_all(self, ranges: Iterable[Served], records: dict[str, PeerRecord]) -> int:
        """Hand every session of ``ranges`` to a successor; how many moved (the others stay, unchanged)."""
        moved = 0
        for served in list(ranges):
            for key in list(served.sessions):
                try:
                    moved += await self.hand_over(served, key, records)
                except Exception as e:  # this session stays here; the client replays, as it would anyway
                    logger.info("could not hand session %s over: %r", key[:8], e)
        return moved

    async def hand_over(self, served: Served, key: str, records: dict[str, PeerRecord]) -> bool:
        """Move session ``key`` of ``served``; False if it has nothing to move or no successor fits."""

        def choose(snapshot: Snapshot) -> tuple[str, tuple[str, ...]] | None:
            successor = pick_successor(
                records, self.peer.peer_id, snapshot.layers, snapshot.max_length_tokens
            )
            if successor is None:
                logger.info("no successor for session %s on layers %s", key[:8], snapshot.layers)
                return None
            return successor.peer_id, tuple(successor.maddrs)

        return await self._send(served, key, choose) is not None

    async def move(
        self,
        served: Served,
        key: str,
        target: str,
        maddrs: tuple[str, ...],
        part: LayerRange | None = None,
    ) -> tuple[int, int]:
        """Hand session ``key`` of ``served`` to ``target``, named by its client (rpc_move): (tokens, KV bytes)
        moved. With ``part``, only those of its layers, and the session stays here too. Raises what went wrong
        (the target refused: its layers, its cache); the session then stays."""
        if target == self.peer.peer_id:
            raise ProtocolError("a session cannot move to the peer it is on")
        session = served.sessions.get(key)
        if session is not None and part is None and session.handover.parted:
            raise ProtocolError(f"session {key[:16]} was handed over in parts already: it cannot go whole")
        # the client names the target, which may refuse (or be no peer at all): one token first, then the bulk
        moved = await self._send(served, key, lambda _snapshot: (target, maddrs), first_tokens=1, part=part)
        if moved is None:
            raise SessionError(f"session {key[:16]} holds no tokens here yet: nothing to move")
        return moved

    async def _send(
        self,
        served: Served,
        key: str,
        choose: Callable[[Snapshot], tuple[str, tuple[str, ...]] | None],
        first_tokens: int = 0,
        part: LayerRange | None = None,
    ) -> tuple[int, int] | None:
        """Freeze session ``key``, send its cache (only ``part`` of its layers, if given) to the peer ``choose``
        names for its snapshot, and close it here unless only a part went: (tokens, KV bytes) sent, or None if
        it had nothing to move or ``choose`` named nobody."""
        session = served.sessions.get(key)
        if session is None:
            return None
        state = session.handover
        if state.frozen is not None:  # one hand-over of a session at a time: each would send it all
            raise SessionError(f"session {key[:16]} is being handed over already")
        reserved = set(range(part.start, part.end)) if part is not None else set()
        if reserved & state.parted:
            raise ProtocolError(f"layers of {part} of session {key[:16]} were handed over already")
        state.parted |= reserved  # so a concurrent ask for them is refused; given back unless they went
        frozen = state.frozen = asyncio.get_running_loop().create_future()
        whole = went = False
        try:
            async with self._idle:  # the step already computing finishes first
                await self._idle.wait_for(lambda: not state.in_flight)
            snapshot = await self.peer.executor.call(lambda: read_session(served.blocks, key, part))
            if snapshot is None:
                return None
            whole = snapshot.layers == snapshot.held and state.parted == reserved
            chosen = choose(snapshot)
            if chosen is None:
                return None
            successor, maddrs = chosen
            session_id, origin = key.rsplit("@", 1)
            began, sent_bytes = time.perf_counter(), 0
            requests = chunks(snapshot, session_id, origin, self.peer.spec.weights_hash, first_tokens)
            for request in requests:
                sent_bytes += 2 * request.keys.numel() * request.keys.element_size()
                installed = await call_handover(
                    self.p2p, successor, request, maddrs=maddrs, timeout_s=CHUNK_TIMEOUT_S
                )
            if not installed:
                raise ProtocolError(f"{successor[-8:]} did not confirm the hand-over")
            went = True
            if whole:
                self._remember_moved(key, successor)
            logger.info(
                "handed session %s (%d tokens, %d KV bytes) over to %s in %.3f s: layers %s",
                key[:8],
                snapshot.position,
                sent_bytes,
                successor[-8:],
                time.perf_counter() - began,
                snapshot.layers,
            )
        finally:
            if not went:
                state.parted -= reserved
            state.frozen = None
            frozen.set_result(None)
        if whole:
            await self.peer.close(key)
        return snapshot.position, sent_bytes

    def _remember_moved(self, key: str, successor: str) -> None:
        now = self.peer.clock()
        self.moved.pop(key, None)
        self.moved[key] = (successor, now)
        horizon = now - self.peer.config.idle_timeout_s
        while (oldest := next(iter(self.moved))) != key and self.moved[oldest][1] < horizon:
            del self.moved[oldest]
            self._told.discard(oldest)

    async def wait_told(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until every moved session's client was told where it went (a client
        that steps after we are gone fails over and replays: correct, only slower)."""
        if set(self.moved) <= self._told:
            return
        self._all_told.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._all_told.wait()

    # ------------------------------------------------------------------ receiver

    async def install(self, request: HandoverRequest, remote_id: str) -> HandoverReply:
        """Take one chunk of a session handed to us; the reply says whether the session is complete."""
        layers = LayerRange(request.start, request.end)
        key = session_key(request.origin, request.session_id)
        self.peer.check_request(request.model_hash, layers, self.peer.spec.hidden_size)
        first = request.layer == request.start and request.token_start == 0
        # a half-sent session that expired (the reaper) is gone with its Session, incoming state and all
        served = self.peer.find(key)
        session = served.sessions[key] if served is not None else None
        if first:
            if session is not None:
                raise SessionError(f"session {key[:16]} is already open here")
            if self.peer.status not in (Status.SERVING, Status.MOVING):
                raise SessionError("this peer is not serving: it takes no hand-over")
            # Opens like a first step: caps checked, counted against the sender's share (CapacityError).
            served = await self.peer.session_for(key, remote_id, layers, 0, request.max_length_tokens)
            session = served.sessions[key]
            session.handover.incoming = Incoming(layers, request.position, request.start, 0)
        if served is None or session is None or session.handover.incoming is None:
            raise SessionError(f"no hand-over of session {key[:16]} under way here: send its first chunk")
        incoming = session.handover.incoming
        try:
            self._check_chunk(incoming, request)
            chunk_keys = request.keys.to(served.blocks.dtype)
            chunk_values = request.values.to(served.blocks.dtype)
            cache = served.blocks.cache.get(key)
            await self.peer.executor.call(lambda: cache.append(request.layer, chunk_keys, chunk_values))
        except BaseException:
            session.handover.incoming = None
            await self.peer.close(key)
            raise
        incoming.token += request.keys.shape[1]
        if incoming.token < incoming.position:
            return HandoverReply(False)
        if incoming.layer + 1 < layers.end:
            incoming.layer, incoming.token = incoming.layer + 1, 0
            return HandoverReply(False)
        session.handover.incoming = None
        self.peer.touch(key)
        logger.info("installed session %s (%d tokens) from %s", key[:8], incoming.position, remote_id[-8:])
        return HandoverReply(True)

    def _check_chunk(self, incoming: Incoming, request: HandoverRequest) -> None:
        spec = self.peer.spec
        if (request.start, request.end, request.position) != (
            incoming.layers.start,
            incoming.layers.end,
            incoming.position,
        ) or (request.layer, request.token_start) != (incoming.layer, incoming.token):
            raise ProtocolError(
                f"hand-over chunk for layer {request.layer} at token {request.token_start}: expected layer "
                f"{incoming.layer} at token {incoming.token} of the same session"
            )
        if request.token_start + request.keys.shape[1] > incoming.position:
            raise ProtocolError(f"hand-over chunk runs past the session's position {incoming.position}")
        shape = (spec.num_kv_heads, request.keys.shape[1], spec.head_dim)
        if tuple(request.keys.shape) != shape:
            raise ProtocolError(f"hand-over keys shaped {list(request.keys.shape)}, expected {list(shape)}")
        if request.keys.dtype.is_floating_point is False:
            raise ProtocolError(f"hand-over keys in {request.keys.dtype}: a float dtype is expected")


def read_session(blocks: BlockRange, key: str, part: LayerRange | None = None) -> Snapshot | None:
    """Copy session ``key``'s cache (only ``part`` of its layers, if given) on the torch thread; None when it
    has no tokens or its layers disagree (a session half-way through a step: not worth moving). ProtocolError if
    it does not hold all of ``part``."""
    try:
        cache = blocks.cache.get(key)
    except SessionError:
        return None
    used = [i for i, n in enumerate(cache.lengths) if n > 0]
    if not used:
        return None
    first, last = used[0], used[-1]
    position = cache.lengths[first]
    if any(n != position for n in cache.lengths[first : last + 1]):
        return None
    held = LayerRange(cache.layers.start + first, cache.layers.start + last + 1)
    layers = part or held
    if not held.covers(layers):
        raise ProtocolError(f"session holds layers {held} here: cannot move layers {layers}")
    keys, values = [], []
    for layer in range(layers.start, layers.end):
        k, v = cache.gather(layer, position)
        keys.append(k.to("cpu", copy=True))
        values.append(v.to("cpu", copy=True))
    return Snapshot(key, cache.max_length_tokens, layers, position, keys, values, held)


def chunks(
    snapshot: Snapshot, session_id: str, origin: str, model_hash: str, first_tokens: int = 0
) -> list[HandoverRequest]:
    """The snapshot as HandoverRequests of at most CHUNK_BYTES each, in the order the receiver expects; with
    ``first_tokens``, the very first chunk holds only that many tokens (the target opens the session, or
    refuses, before the bulk is sent)."""
    out = []
    for i, (k, v) in enumerate(zip(snapshot.keys, snapshot.values, strict=True)):
        per_token = 2 * k.shape[0] * k.shape[2] * k.element_size()
        span = max(1, CHUNK_BYTES // per_token)
        starts = list(range(0, snapshot.position, span))
        if i == 0 and 0 < first_tokens < snapshot.position:
            starts = [0, *range(first_tokens, snapshot.position, span)]
        for t, end in zip(starts, [*starts[1:], snapshot.position], strict=True):
            out.append(
                HandoverRequest(
                    session_id=session_id,
                    origin=origin,
                    position=snapshot.position,
                    max_length_tokens=snapshot.max_length_tokens,
                    start=snapshot.layers.start,
                    end=snapshot.layers.end,
                    model_hash=model_hash,
                    layer=snapshot.layers.start + i,
                    token_start=t,
                    keys=k[:, t:end].contiguous(),
                    values=v[:, t:end].contiguous(),
                )
            )
    return out


def pick_successor(
    records: dict[str, PeerRecord], self_id: str, layers: LayerRange, max_length_tokens: int
) -> PeerRecord | None:
    """The serving peer (not us) whose range covers ``layers`` with the most free cache, if it fits the
    session's reservation."""
    fits = [
        r
        for r in records.values()
        if r.peer_id != self_id
        and r.state == "serving"
        and r.range_start <= layers.start
        and layers.end <= r.range_end
        and r.free_cache_tokens >= max_length_tokens
    ]
    return max(fits, key=lambda r: (r.free_cache_tokens, r.peer_id), default=None)
