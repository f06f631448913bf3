"""The peer's state and its one owner, ``Peer``: status, the block ranges it serves, the sessions on each.

    status:   joining -> serving <-> moving -> draining -> leaving
    ranges:   usually one ``Served`` (a BlockRange with its own KV cache and its sessions, each a ``Session``
              that holds everything of it, swarm/peer/session.py); two while the peer
              moves (make before break): the newest range takes new sessions, an older one keeps serving the
              sessions it opened until they end, then it is dropped (both are in the record meanwhile). A
              session stays on the range it opened on, unless that range grows (carry_over): a new range that
              contains the old one takes its sessions, caches and all, in its place.

Handlers, the plan follower, the announcer and the reaper get the Peer and act through its methods; nobody else
writes its fields. Everything here runs on the event loop; the torch work (opening a KV cache, a forward) goes
through the Executor, which runs it on the device's thread.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm import PROTOCOL_VERSION
from swarm.dht import MAX_OLDER_RANGES, LinkMeasure, OlderRange, PeerRecord
from swarm.errors import CapacityError, ModelMismatch, ProtocolError, SessionError
from swarm.models.blocks import BlockRange
from swarm.models.spec import ModelSpec, dtype_name
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.live import LiveView
from swarm.peer.measure import ComputeMeasure
from swarm.peer.session import Session
from swarm.types import LayerRange
from swarm.wire import CacheStats, Hop

logger = logging.getLogger(__name__)

MAX_CLOSED_KEPT = 10_000  # session closes remembered (closed_since) at most


class Status(enum.StrEnum):
    JOINING = "joining"  # loading layers and measuring: not serving yet
    SERVING = "serving"
    MOVING = "moving"  # following a new plan: serving while loading the next range
    DRAINING = "draining"  # leaving: no new sessions, open ones may finish
    LEAVING = "leaving"  # drained: withdrawing the record


# What the DHT record says of each status (clients route only to "serving").
_RECORD_STATE = {
    Status.JOINING: "loading",
    Status.SERVING: "serving",
    Status.MOVING: "serving",
    Status.DRAINING: "leaving",
    Status.LEAVING: "leaving",
}


@dataclass(frozen=True)
class Identity:
    """Who the peer is on the network (fixed for its lifetime)."""

    peer_id: str
    name: str
    maddrs: tuple[str, ...]
    memory_bytes: int  # memory budget
    max_layers: int  # most layers that fit in it with the KV cache


def session_key(origin: str, session_id: str) -> str:
    """Where a session lives on this peer: its id as named by its client, ``origin``.

    The route's first hop authenticates the client (its remote peer) and passes its id down the route, so a
    stranger that names the same session id as its own client reaches a different session: to step, rewind
    or close ours it must know our id, a random secret that only our route's hops see (and they can already
    spoil our outputs; the spot-checks are for that). Keyed by the client rather than by the hop before us, a
    session survives a change of that hop: after a failover or a hand-over upstream, we keep our cache.
    """
    return f"{session_id}@{origin}"


@dataclass(eq=False)
class Served:
    """One block range being served: its BlockRange (weights + KV cache) and the sessions opened on it."""

    blocks: BlockRange
    sessions: dict[str, Session] = field(default_factory=dict)
    accepting: bool = True  # takes new sessions

    @property
    def range(self) -> LayerRange:
        return self.blocks.range


class Peer:
    """Owns the peer's mutable state. Build it, then ``serve(blocks)`` once the first range is loaded."""

    def __init__(
        self,
        identity: Identity,
        spec: ModelSpec,
        executor: Executor,
        config: SessionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        read_live: Callable[[], Awaitable[Iterable[str]]] | None = None,
    ) -> None:
        """``read_live`` reads the peer ids in the DHT now (for a re-read before refusing a route's hop)."""
        self.identity = identity
        self.spec = spec
        self.executor = executor
        self.config = config or SessionConfig()
        self.clock = clock
        self.status = Status.JOINING
        self.ranges: list[Served] = []  # oldest first; the last accepting one takes new sessions
        self.compute = ComputeMeasure(0.0, 0.0, 0.0)
        self.reachable: bool | None = None
        self.links: Mapping[str, LinkMeasure] = {}
        # Peer ids in our latest read of the DHT (any state); None until a read that lists us came in.
        self.live = LiveView(identity.peer_id, clock, read_live)  # the swarm's peer ids, as we last read them
        self.changed = asyncio.Event()  # set when the record changed in a way worth announcing at once
        self._sessions_changed = asyncio.Event()  # a session opened, began opening, or closed
        self._opening: dict[str, asyncio.Future[None]] = {}  # sessions whose first step is opening them
        # sessions whose first step just failed here -> when (kept for order_wait_s, for the attempt's later steps)
        self._open_failed: dict[str, float] = {}
        # sessions their clients closed -> (when, whether they were open here): see closed_memory_s
        self._closed: dict[str, tuple[float, bool]] = {}

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # ------------------------------------------------------------------ ranges

    @property
    def current(self) -> Served | None:
        """The range that takes new sessions (the newest accepting one)."""
        return next((s for s in reversed(self.ranges) if s.accepting), None)

    @property
    def held(self) -> LayerRange | None:
        """The layers announced to the swarm: those of the current range."""
        current = self.current
        return current.range if current is not None else None

    def serve(self, blocks: BlockRange) -> Served:
        """Serve ``blocks`` from now on: new sessions open there; older ranges keep only their sessions."""
        for older in self.ranges:
            older.accepting = False
        blocks.cache.use_clock(self.clock, self.config.evict_idle_s)
        blocks.cache.share_prefixes = self.config.share_prefixes
        served = Served(blocks)
        self.ranges.append(served)
        if self.status is Status.JOINING:
            self.status = Status.SERVING
        self.changed.set()
        logger.info("serving layers %s", blocks.range)
        return served

    async def carry_over(self, blocks: BlockRange) -> Served:
        """Serve ``blocks``, which contain the current range's layers, in its place: its sessions stay open with
        the same keys and caches (blocks.carry_sessions), new sessions open on ``blocks``, and the old range is
        gone at once (no second copy of the shared layers, no drain).

        The swap runs on the torch thread, after whatever runs there now: a session whose open already ran is
        carried over, and one opening later opens on ``blocks`` (its open reads ``served.blocks`` there)."""
        served = self.current
        if served is None or not blocks.range.covers(served.range):
            raise ValueError(f"cannot carry the sessions of {self.held} over to {blocks.range}")

        blocks.cache.use_clock(self.clock, self.config.evict_idle_s)
        blocks.cache.share_prefixes = self.config.share_prefixes

        def swap() -> None:
            blocks.carry_sessions(served.blocks)
            served.blocks = blocks

        await self.executor.release(swap)  # past the queue: a full queue must not fail a move half-way
        self.changed.set()
        logger.info("serving layers %s (%d sessions carried over)", blocks.range, len(served.sessions))
        return served

    def set_moving(self, moving: bool) -> None:
        if self.status in (Status.SERVING, Status.MOVING):
            self.status = Status.MOVING if moving else Status.SERVING

    async def wait_sessions_ended(self, served: Served, timeout_s: float) -> bool:
        """Wait until ``served`` has no sessions, at most ``timeout_s``; True if it emptied."""
        try:
            async with asyncio.timeout(timeout_s):
                while served.sessions:
                    self._sessions_changed.clear()
                    await self._sessions_changed.wait()
        except TimeoutError:
            return False
        return True

    async def drop(self, served: Served) -> None:
        """Stop serving ``served``; sessions still on it are closed (their next step gets SessionError)."""
        if served.sessions:
            logger.info("closing %d sessions still open on layers %s", len(served.sessions), served.range)
        for session_id in list(served.sessions):
            await self._close_on(served, session_id)
        if served in self.ranges:
            self.ranges.remove(served)
        self.changed.set()

    # ------------------------------------------------------------------ sessions

    def find(self, key: str) -> Served | None:
        return next((s for s in self.ranges if key in s.sessions), None)

    def check_request(self, model_hash: str, layers: LayerRange, hidden_size: int) -> None:
        """Raise if a step for ``layers`` cannot run on this model (before any state is touched)."""
        if model_hash != self.spec.weights_hash:
            raise ModelMismatch(
                f"this peer serves {self.spec.name} with hash {self.spec.weights_hash[:12]}, "
                f"the request is for hash {model_hash[:12]}"
            )
        if hidden_size != self.spec.hidden_size:
            raise ProtocolError(
                f"hidden size {hidden_size} does not match the model's {self.spec.hidden_size}"
            )

    def check_route(self, layers: LayerRange, route_rest: Sequence[Hop]) -> None:
        """ProtocolError unless this step and the hops after it are one pass over the model: a route naming a
        peer twice (A, B, A, B, ...) or repeating layers would cost the swarm up to MAX_ROUTE_HOPS honest steps.
        Before any compute; ``check_live`` then checks that each hop is a live peer of the swarm.
        """
        num_layers = self.spec.num_layers
        if layers.end > num_layers:
            raise ProtocolError(f"layers {layers} are past the model's {num_layers} layers")
        if 1 + len(route_rest) > num_layers:
            raise ProtocolError(f"route of {1 + len(route_rest)} hops for a model of {num_layers} layers")
        seen, end = {self.peer_id}, layers.end
        for i, hop in enumerate(route_rest):
            if hop.peer_id in seen:
                raise ProtocolError(f"route names peer {hop.peer_id[-8:]} twice (hop {i + 1})")
            if hop.start != end or hop.end > num_layers:
                raise ProtocolError(
                    f"route hop {i + 1} runs layers {hop.start}:{hop.end} after layer {end} of "
                    f"{num_layers}: hops must be contiguous and within the model"
                )
            seen.add(hop.peer_id)
            end = hop.end

    def set_live_peers(self, peer_ids: Iterable[str]) -> None:
        """The peer ids of a fresh DHT read (the link monitor's, every poll)."""
        self.live.update(peer_ids)

    async def check_live(self, route_rest: Sequence[Hop]) -> None:
        """CapacityError unless every hop is a live peer of the swarm (see swarm.peer.live)."""
        await self.live.check(route_rest)

    @property
    def live_peers(self) -> frozenset[str] | None:
        return self.live.peer_ids

    async def session_for(
        self, key: str, owner: str, layers: LayerRange, position: int, max_length_tokens: int
    ) -> Served:
        """The range that runs this step of session ``key`` (see session_key): where it is open, else where
        it opens now for ``owner``.

        A later step (position > 0) may overtake the session's first step on the way (a client pipelines a
        long prompt as chunks sent without waiting): it waits, at most ``order_wait_s``, for the first step
        to open the session, and fails at once if that open fails. The executor then runs the steps in
        position order (Executor.forward)."""
        served = self.find(key)
        if served is None and position == 0:
            closed = self._closed.get(key)
            if closed is not None and not closed[1]:  # its close came first: the client has gone
                raise SessionError(f"session {key[:16]} was closed by its client before this step came")
            return await self._open(key, owner, layers, max_length_tokens)
        opening = self._opening.get(key)
        if served is None or opening is not None:  # not open yet, or its first step is opening it
            await self._wait_opened(key)
            served = self.find(key)
        if served is None:
            raise SessionError(
                f"unknown session {key[:16]} at position {position} (expired or never opened): "
                "reopen it and replay the prefix"
            )
        if not served.range.covers(layers):
            raise CapacityError(f"layers {layers} requested, session is open on {served.range}")
        return served

    async def _wait_opened(self, key: str) -> None:
        """Wait up to ``order_wait_s`` for session ``key``'s first step to open it; SessionError if its open
        failed. Returns on a timeout too (the session expired or never opened: the caller says so)."""
        failed_s = self._open_failed.get(key)
        if failed_s is not None and self.clock() - failed_s < self.config.order_wait_s:
            raise SessionError(f"session {key[:16]}: its first step failed here")
        opening = self._opening.get(key)
        if opening is None:  # a placeholder that the first step's _open settles
            opening = self._opening[key] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self.config.order_wait_s):
                await asyncio.shield(opening)
        except TimeoutError:
            if self._opening.get(key) is opening and self.find(key) is None:
                del self._opening[key]
            logger.debug("session %s: no first step within %.1f s", key[:8], self.config.order_wait_s)

    def touch(self, key: str) -> None:
        served = self.find(key)
        if served is not None:
            served.sessions[key].last_used_s = self.clock()

    def session(self, key: str) -> Session | None:
        """Session ``key`` (see session_key) if it is open here."""
        served = self.find(key)
        return served.sessions[key] if served is not None else None

    async def _open(self, key: str, owner: str, layers: LayerRange, max_length_tokens: int) -> Served:
        # Later steps of the session that overtook this first one wait on `opening` (_wait_opened).
        self._open_failed.pop(key, None)
        opening = self._opening.get(key)
        if opening is None:
            opening = self._opening[key] = asyncio.get_running_loop().create_future()
        try:
            served = await self._reserve_and_open(key, owner, layers, max_length_tokens)
        except BaseException as e:
            _settle(opening, SessionError(f"session {key[:16]}: its first step failed here ({e!r})"))
            # Steps of this attempt still on their way fail at once too; the replay's first step clears it.
            now = self._open_failed[key] = self.clock()
            while (
                next(iter(self._open_failed.values())) < now - self.config.order_wait_s
            ):  # their steps failed
                del self._open_failed[next(iter(self._open_failed))]
            raise
        finally:
            self._opening.pop(key, None)  # a waiter that gave up may have dropped it already
        _settle(opening, None)
        return served

    async def _reserve_and_open(
        self, key: str, owner: str, layers: LayerRange, max_length_tokens: int
    ) -> Served:
        served = self.current
        if self.status in (Status.DRAINING, Status.LEAVING) or served is None:
            raise CapacityError("peer is leaving the swarm and takes no new sessions")
        if not served.range.covers(layers):
            # Usually a stale route after this peer followed a new plan: an honest peer, so "route elsewhere"
            # (CapacityError) rather than ProtocolError, which would get it banned as misbehaving.
            raise CapacityError(f"layers {layers} requested, this peer holds {served.range}")
        self._check_capacity(served, owner, max_length_tokens)
        # Reserve the slot before awaiting so two first steps of one session cannot both open it.
        now = self.clock()
        session = served.sessions[key] = Session(owner, max_length_tokens, now, now)
        try:
            await self.executor.call(lambda: served.blocks.open_session(key, max_length_tokens))
        except BaseException:
            if served.sessions.get(key) is session:
                del served.sessions[key]
            self._sessions_changed.set()
            # Cancelled, the open may still run or have run (one running on the thread cannot be stopped, and
            # one that just finished may not have woken us yet): free whatever it reserved. The release runs
            # on the same thread after it, or first, in which case the executor skips the cancelled open.
            await self.executor.release(lambda: _forget(served.blocks, key))
            raise
        if served.sessions.get(key) is not session:  # closed (drop, drain) while it opened: free its cache
            await self.executor.release(lambda: _forget(served.blocks, key))
            raise SessionError(f"session {key[:16]} was closed while it opened")
        logger.debug("opened session %s (%d tokens) on %s", key[:8], max_length_tokens, served.range)
        return served

    def _check_capacity(self, served: Served, owner: str, max_length_tokens: int) -> None:
        """CapacityError if this peer, or ``owner``'s share of it, cannot take one more session. The session's
        cache is taken as its steps come (and idle sessions' cache taken back for it, swarm/models/kv_cache.py);
        here its owner's held cache must leave room for a block of it within its share."""
        if self.session_count >= self.config.max_open:
            raise CapacityError(f"peer has {self.session_count} open sessions, its limit")
        cache = served.blocks.cache
        if max_length_tokens > cache.cache_tokens:
            raise CapacityError(
                f"session asks for up to {max_length_tokens} cache tokens, this peer has {cache.cache_tokens}"
            )
        owned = [s for r in self.ranges for s in r.sessions.values() if s.owner == owner]
        if len(owned) >= self.config.max_sessions_per_remote:
            raise CapacityError(f"{owner[-8:]} has {len(owned)} sessions open here, the most one peer may")
        # Each range has its own cache: the share is of the one the session opens on.
        held = cache.held_tokens([k for k, s in served.sessions.items() if s.owner == owner])
        share = int(self.config.max_remote_cache_fraction * cache.cache_tokens)
        if held + cache.pool.block_tokens > share:
            raise CapacityError(
                f"{owner[-8:]} holds {held} cache tokens here: no room for another session within the {share} "
                "one peer may hold"
            )

    async def close_for_client(self, key: str) -> bool:
        """Close session ``key`` at its client's word, and remember that it did (``closed_since``): a step of
        it still on its way must neither open it again nor go on to the next hop."""
        now = self.clock()
        while self._closed and (
            next(iter(self._closed.values()))[0] < now - self.config.closed_memory_s
            or len(self._closed) >= MAX_CLOSED_KEPT  # anyone may close any id: the oldest go first
        ):
            del self._closed[next(iter(self._closed))]
        self._closed.pop(key, None)
        self._closed[key] = (now, self.find(key) is not None)  # before the close: a running step sees it
        return await self.close(key)

    def closed_since(self, key: str, since_s: float) -> bool:
        """Whether session ``key``'s client closed it at or after ``since_s`` (the Peer's clock)."""
        closed = self._closed.get(key)
        return closed is not None and closed[0] >= since_s

    async def close(self, key: str) -> bool:
        """Close session ``key`` (see session_key) wherever it is open; False if it is not."""
        served = self.find(key)
        if served is None:
            return False
        await self._close_on(served, key)
        return True

    async def _close_on(self, served: Served, key: str) -> None:
        if served.sessions.pop(key, None) is None:
            return
        self._sessions_changed.set()
        self.executor.forget(key)
        # Not through the bounded queue: freeing memory must work most of all when the peer is busy.
        await self.executor.release(lambda: _forget(served.blocks, key))
        logger.debug("closed session %s", key[:8])

    @property
    def session_count(self) -> int:
        return sum(len(s.sessions) for s in self.ranges)

    def expired_sessions(self) -> list[str]:
        """Sessions with no step for longer than the idle timeout, or open for longer than their lifetime (a
        trickle of tiny steps cannot hold a reservation forever)."""
        now = self.clock()
        idle_since, opened_before = now - self.config.idle_timeout_s, now - self.config.max_session_lifetime_s
        return [
            key
            for served in self.ranges
            for key, session in served.sessions.items()
            if session.last_used_s < idle_since or session.opened_s < opened_before
        ]

    async def reap(self) -> int:
        """Close expired sessions; how many were closed."""
        expired = self.expired_sessions()
        for key in expired:
            logger.info("session %s idle or past its lifetime: closing it", key[:8])
            await self.close(key)
        return len(expired)

    def stop_accepting(self) -> None:
        """Start leaving: no new sessions from now on (the record says "leaving")."""
        if self.status is not Status.LEAVING:
            self.status = Status.DRAINING
        self.changed.set()

    async def drain(self, grace_s: float) -> None:
        """Take no new sessions; let open ones finish for up to ``grace_s``, then close the rest."""
        self.stop_accepting()
        deadline = self.clock() + grace_s
        for served in list(self.ranges):
            await self.wait_sessions_ended(served, max(0.0, deadline - self.clock()))
        for served in list(self.ranges):
            for session_id in list(served.sessions):
                await self._close_on(served, session_id)
        self.status = Status.LEAVING

    # ------------------------------------------------------------------ what we announce

    @property
    def cache_tokens_total(self) -> int:
        current = self.current
        return int(current.blocks.cache.cache_tokens) if current is not None else 0

    @property
    def free_cache_tokens(self) -> int:
        current = self.current
        return int(current.blocks.free_cache_tokens) if current is not None else 0

    @property
    def cache_stats(self) -> CacheStats | None:
        """Blocks used, shared and free in the range it serves, and prefix sharing so far (rpc_info)."""
        current = self.current
        if current is None:
            return None
        cache = current.blocks.cache
        pool, free = cache.pool, cache.pool.free_blocks
        return CacheStats(
            pool.block_tokens,
            pool.blocks - free,
            pool.shared_blocks,
            free,
            cache.prefix_tokens_looked_up,
            cache.prefix_tokens_shared,
        )

    def set_links(self, links: Mapping[str, LinkMeasure]) -> None:
        """Fresh link measurements; a new or lost link is worth announcing at once."""
        if set(links) != set(self.links):
            self.changed.set()
        self.links = dict(links)

    def older_ranges(self) -> list[OlderRange]:
        """The ranges that serve only the sessions they opened (newest first, at most MAX_OLDER_RANGES)."""
        current = self.current
        older = [s for s in reversed(self.ranges) if s is not current and s.sessions]
        return [
            OlderRange(start=s.range.start, end=s.range.end, sessions=len(s.sessions))
            for s in older[:MAX_OLDER_RANGES]
        ]

    def record(self) -> PeerRecord:
        """Our DHT record as of now."""
        held = self.held  # None while a peer moving in steps serves only its old range's sessions
        start, end = (held.start, held.end) if held is not None else (0, 0)
        serving = self.status in (Status.SERVING, Status.MOVING)
        total, free = self.cache_tokens_total, self.free_cache_tokens
        blocks = self.ranges[-1].blocks if self.ranges else None
        return PeerRecord(
            peer_id=self.peer_id,
            name=self.identity.name,
            maddrs=list(self.identity.maddrs),
            protocol_version=PROTOCOL_VERSION,
            model_name=self.spec.name,
            model_hash=self.spec.weights_hash,
            num_layers=self.spec.num_layers,
            hidden_size=self.spec.hidden_size,
            device=str(blocks.device) if blocks is not None else "",
            dtype=dtype_name(blocks.dtype) if blocks is not None else "",
            quant=blocks.quant if blocks is not None else "none",  # type: ignore[arg-type]
            memory_bytes=self.identity.memory_bytes,
            state=_RECORD_STATE[self.status],  # type: ignore[arg-type]
            range_start=start,
            range_end=end,
            decode_layer_tokens_s_b1=self.compute.decode_layer_tokens_s_b1,
            decode_layer_tokens_s_b8=self.compute.decode_layer_tokens_s_b8,
            prefill_layer_tokens_s=self.compute.prefill_layer_tokens_s,
            max_layers=self.identity.max_layers,
            cache_tokens_total=total,
            free_cache_tokens=free if serving else 0,
            active_sessions=self.session_count,
            load=min(1.0, 1.0 - free / max(1, total)),
            links=dict(self.links),
            older_ranges=self.older_ranges() if serving else [],
            reachable=self.reachable,
            updated_at=0.0,
        )


def _settle(opening: asyncio.Future[None], error: SessionError | None) -> None:
    """Tell the steps waiting for a session's open how it went."""
    if error is None:
        opening.set_result(None)
        return
    opening.set_exception(error)
    opening.exception()  # retrieved: nobody may be waiting, which is no reason to log it


def _forget(blocks: BlockRange, key: str) -> None:
    """Free ``key``'s cache on ``blocks`` (on the torch thread); a session that never reached it is fine."""
    try:
        blocks.close_session(key)
    except SessionError:
        pass
