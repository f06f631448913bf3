"""Which peers of the swarm are live, as this peer last read the DHT: routes may name only those as next hops.

Without this check, any caller could have a peer dial (and push activations to) any id at any address. The
view is the swarm watch's latest read of the peer records (swarm.dht.watch: at each membership change, else
every few seconds while no planner's summary can be relied on); it is owned by the Peer, which
updates it through ``Peer.set_live_peers`` and checks routes through ``Peer.check_live``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from swarm.errors import CapacityError
from swarm.wire import Hop

logger = logging.getLogger(__name__)

REREAD_S = 1.0  # at most one extra DHT read per second for routes naming a hop we have not seen
REREAD_TIMEOUT_S = 5.0


class LiveView:
    """The live peer ids; None until a read that lists this peer came in."""

    def __init__(
        self,
        own_peer_id: str,
        clock: Callable[[], float],
        read: Callable[[], Awaitable[Iterable[str]]] | None = None,
    ) -> None:
        self.own_peer_id = own_peer_id
        self.clock = clock
        self.read = read  # reads the peer ids in the DHT now (a re-read before refusing a hop)
        self.peer_ids: frozenset[str] | None = None
        self._reread_lock = asyncio.Lock()
        self._reread_after_s = float("-inf")

    def update(self, peer_ids: Iterable[str]) -> None:
        """A fresh read. One that does not list this peer (we announce every ttl/3, so it always should) is
        incomplete, a DHT hiccup: it is ignored rather than make us refuse every route."""
        live = frozenset(peer_ids)
        if self.own_peer_id in live:
            self.peer_ids = live

    async def check(self, route_rest: Sequence[Hop]) -> None:
        """CapacityError naming the first hop that is not a peer of the swarm as we last read it.

        Our read is up to a poll old, so a peer that joined seconds ago may be missing: before refusing, we
        read the DHT again (at most once per REREAD_S, so strangers cannot make us read it at will). A
        refusal is a CapacityError, not a ProtocolError: the client routes around that hop for the session
        and bans nobody. Until our first read (just started) we check nothing: refusing every route would
        turn a new peer away, and Peer.check_route still bounds the work."""
        unknown = self._unknown_hop(route_rest)
        if unknown is None:
            return
        async with self._reread_lock:  # one re-read at a time; those waiting on it see its result
            unknown = self._unknown_hop(route_rest)
            if unknown is not None and self.read is not None and self.clock() >= self._reread_after_s:
                self._reread_after_s = self.clock() + REREAD_S
                try:
                    async with asyncio.timeout(REREAD_TIMEOUT_S):
                        self.update(await self.read())
                except Exception as e:  # a failed read proves nothing: we judge by the view we have
                    logger.info("re-reading the live peers failed: %r", e)
                unknown = self._unknown_hop(route_rest)
        if unknown is not None:
            i, hop = unknown
            error = CapacityError(
                f"route hop {i + 1} ({hop.peer_id[-8:]}) is not a live peer of the swarm as this peer "
                "last read it: route around it"
            )
            error.failed_peer_id = hop.peer_id
            raise error

    def _unknown_hop(self, route_rest: Sequence[Hop]) -> tuple[int, Hop] | None:
        live = self.peer_ids
        if live is None:
            return None
        return next(((i, hop) for i, hop in enumerate(route_rest) if hop.peer_id not in live), None)
