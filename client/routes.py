"""Routes for the client's sessions: DHT snapshots turned into swarm.routing views, one long-lived Router.

The Router is pure and keeps one IWRR per plan node, so it lives as long as the plan epoch does: consecutive
sessions then interleave over the plan's flows instead of all starting from the same pick. Bans are shared
across epochs, since a peer that just failed is no better under a new plan.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from swarm.dht import PeerRecord, SwarmSnapshot
from swarm.errors import NoRouteError
from swarm.routing import BanConfig, BanList, PeerState, Route, Router, RoutingView
from swarm.types import LayerRange, NodeID, Plan, coverage

logger = logging.getLogger(__name__)

Snapshotter = Callable[[], Awaitable[SwarmSnapshot]]


def peer_state(record: PeerRecord, cache_high_water: float) -> PeerState:
    """What routing needs from one announcement. A peer fuller than `cache_high_water` takes no new session."""
    per_layer = record.decode_layer_tokens_s_b1
    return PeerState(
        peer_id=NodeID(record.peer_id),
        layers=LayerRange(record.range_start, record.range_end),
        free_cache_tokens=record.free_cache_tokens,
        compute_s_per_layer=1.0 / per_layer if per_layer > 0 else 0.0,
        cache_high_water_tokens=int((1.0 - cache_high_water) * record.cache_tokens_total),
    )


def routing_view(
    snapshot: SwarmSnapshot, num_layers: int, cache_high_water: float, avoid: frozenset[NodeID] = frozenset()
) -> RoutingView:
    """The serving peers of `snapshot` as routing sees them, less those in `avoid`."""
    peers = [
        peer_state(r, cache_high_water)
        for r in snapshot.serving().values()
        if r.range_start < r.range_end <= num_layers and NodeID(r.peer_id) not in avoid
    ]
    return RoutingView.of(num_layers, peers)


class SwarmRoutes:
    """Builds routes from fresh-enough DHT snapshots; implements client.session.RouteSource."""

    def __init__(
        self,
        snapshot: Snapshotter,
        num_layers: int,
        *,
        cache_high_water: float,
        snapshot_max_age_s: float,
        bans: BanConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_snapshot = snapshot
        self.num_layers = num_layers
        self.cache_high_water = cache_high_water
        self.snapshot_max_age_s = snapshot_max_age_s
        self.bans = BanList(clock, bans)
        self._clock = clock
        self._snapshot: SwarmSnapshot | None = None
        self._read_at = -float("inf")
        self._router: Router | None = None
        self._epoch: int | None = None
        self._lock = asyncio.Lock()  # one DHT read at a time; concurrent sessions share its result

    async def snapshot(self, force: bool = False) -> SwarmSnapshot:
        async with self._lock:
            stale = self._clock() - self._read_at > self.snapshot_max_age_s
            if force or stale or self._snapshot is None:
                self._snapshot = await self._read_snapshot()
                self._read_at = self._clock()
            return self._snapshot

    def router(self, snapshot: SwarmSnapshot) -> Router:
        epoch = snapshot.plan.epoch if snapshot.plan is not None else None
        if self._router is None or epoch != self._epoch:
            plan = Plan.from_json(snapshot.plan.plan) if snapshot.plan is not None else None
            self._router, self._epoch = Router(plan, bans=self.bans), epoch
            if plan is not None:
                logger.info("routing by plan epoch %d (%s)", plan.epoch, plan.method)
        return self._router

    async def route(
        self, start_layer: int, prev: NodeID, session_tokens: int, avoid: frozenset[NodeID] = frozenset()
    ) -> Route:
        """A route (or its tail from `start_layer`, after peer `prev`) that never goes through a peer in
        `avoid`; NoRouteError names missing layers.

        A failure on a cached snapshot is retried once on a fresh one: peers may have joined since.
        """
        try:
            return self._route(await self.snapshot(), start_layer, prev, session_tokens, avoid)
        except NoRouteError:
            return self._route(await self.snapshot(force=True), start_layer, prev, session_tokens, avoid)

    def _route(
        self,
        snapshot: SwarmSnapshot,
        start_layer: int,
        prev: NodeID,
        session_tokens: int,
        avoid: frozenset[NodeID],
    ) -> Route:
        view = routing_view(snapshot, self.num_layers, self.cache_high_water, avoid)
        return self.router(snapshot).route_from(view, start_layer, prev, session_tokens)

    async def holders(self, layers: LayerRange) -> list[NodeID]:
        """Serving, unbanned peers that hold all of `layers` (the candidates to spot-check a stage)."""
        view = routing_view(await self.snapshot(), self.num_layers, 1.0)
        return [
            p for p, state in view.peers.items() if state.layers.covers(layers) and not self.bans.is_banned(p)
        ]

    def ban(self, peer_id: NodeID) -> None:
        seconds = self.bans.ban(peer_id)
        logger.warning("banned peer %s for %.0f s", peer_id[-8:], seconds)

    def succeeded(self, peer_ids: Iterable[NodeID]) -> None:
        for peer_id in peer_ids:
            self.bans.succeeded(peer_id)

    def maddrs(self, peer_id: NodeID) -> tuple[str, ...]:
        record = self._snapshot.peers.get(peer_id) if self._snapshot is not None else None
        return tuple(record.maddrs) if record is not None else ()

    async def wait_for_coverage(self, timeout_s: float) -> SwarmSnapshot:
        """Poll the DHT until serving peers cover every layer; NoRouteError naming the gaps at the deadline."""
        deadline = self._clock() + timeout_s
        while True:
            snapshot = await self.snapshot(force=True)
            view = routing_view(snapshot, self.num_layers, 1.0)
            counts = coverage((p.layers for p in view.peers.values()), self.num_layers)
            missing = [layer for layer, count in enumerate(counts) if count == 0]
            if not missing:
                return snapshot
            if self._clock() >= deadline:
                raise NoRouteError(missing)
            await asyncio.sleep(0.5)
