"""Routes for the client's sessions: DHT snapshots turned into swarm.routing views, one long-lived Router.

The Router is pure and keeps one IWRR per plan node, so it lives as long as the plan epoch does: consecutive
sessions then interleave over the plan's flows instead of all starting from the same pick. Bans are shared
across epochs, since a peer that just failed is no better under a new plan.

Bans only deprioritise: when they leave some layer without a usable holder, the route goes through banned
peers where nobody else holds the layers (fewest such hops first), since a banned peer that serves is better
than no answer. A peer seen dead (it did not answer our own probe) is withdrawn instead: no route goes through
it until the DHT holds a record of it refreshed after the death, so a SIGKILLed peer whose record still says
"serving" for its last TTL is never routed to again, and one that was only slow comes back with its next
announcement.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace

from swarm.dht import PeerRecord, SwarmSnapshot, excluded_peers
from swarm.dht.trust import MAX_LAYER_TOKENS_S, MIN_REPORTERS
from swarm.errors import NoRouteError
from swarm.routing import BanConfig, BanList, PeerState, Route, Router, RoutingConfig, RoutingView
from swarm.routing.observed import announced_layer_tokens_s, discount_plan, flow_factor, speed_ratio
from swarm.routing.route import route_text
from swarm.types import SOURCE, LayerRange, NodeID, coverage

logger = logging.getLogger(__name__)

Snapshotter = Callable[[], Awaitable[SwarmSnapshot]]
Pinger = Callable[
    [NodeID], Awaitable[float]
]  # the round trip to a peer, seconds (raises if it is unreachable)
MAX_PINGS = 16  # peers pinged at once when routes first need their delays
PING_RETRY_S = 60.0  # a peer that did not answer a ping is pinged again no sooner than this
OBSERVED_WEIGHT = 0.3  # weight of the newest observation in a peer's running speed ratio
# Extra hop cost of a banned peer when only banned peers hold some layers: larger than any real route's cost,
# so the route goes through as few banned peers as it can.
BANNED_HOP_PENALTY_S = 1e3
MAX_LINK_DELAY_S = 10.0  # an announced delay past this is no link a route should weigh finely


def peer_state(
    record: PeerRecord,
    cache_high_water: float,
    max_layer_tokens_s: float = MAX_LAYER_TOKENS_S,
    ratio: float = 1.0,
) -> PeerState:
    """What routing needs from one announcement. A peer fuller than `cache_high_water` takes no new session.
    Its speed is the announced one, clamped to `max_layer_tokens_s`, times the observed `ratio`."""
    per_layer = min(record.decode_layer_tokens_s_b1, max_layer_tokens_s) * ratio
    return PeerState(
        peer_id=NodeID(record.peer_id),
        layers=LayerRange(record.range_start, record.range_end),
        free_cache_tokens=record.free_cache_tokens,
        compute_s_per_layer=1.0 / per_layer if per_layer > 0 else 0.0,
        cache_high_water_tokens=int((1.0 - cache_high_water) * record.cache_tokens_total),
    )


def routing_view(
    snapshot: SwarmSnapshot,
    num_layers: int,
    cache_high_water: float,
    avoid: frozenset[NodeID] = frozenset(),
    *,
    min_reporters: int = MIN_REPORTERS,
    max_layer_tokens_s: float = MAX_LAYER_TOKENS_S,
    ratios: Mapping[NodeID, float] | None = None,
    withdrawn: Mapping[NodeID, float] | None = None,
    client_rtt_s: Mapping[NodeID, float] | None = None,
) -> RoutingView:
    """The serving peers of `snapshot` as routing sees them, less those in `avoid`, those reported by
    `min_reporters` distinct reporters, and those `withdrawn` (peer -> the `updated_at` of the record it had
    when it died) whose record has not been refreshed since; `ratios` are observed / announced speeds,
    `client_rtt_s` the round trips this client measured to peers; links between peers as announced."""
    excluded = excluded_peers(snapshot.reports, min_reporters)
    ratios = ratios or {}
    withdrawn = withdrawn or {}
    client_rtt_s = client_rtt_s or {}
    peers = [
        replace(
            peer_state(r, cache_high_water, max_layer_tokens_s, ratios.get(NodeID(r.peer_id), 1.0)),
            latency_s=client_rtt_s.get(NodeID(r.peer_id), 0.0) / 2,
        )
        for r in snapshot.serving().values()
        if r.range_start < r.range_end <= num_layers
        and NodeID(r.peer_id) not in avoid
        and r.peer_id not in excluded
        and r.updated_at > withdrawn.get(NodeID(r.peer_id), -math.inf)
    ]
    return RoutingView.of(num_layers, peers, announced_delays(snapshot))


def announced_delays(snapshot: SwarmSnapshot) -> dict[tuple[NodeID, NodeID], float]:
    """One-way delay between peers as their records announce it: half the measured RTT, from whichever end
    measured it (a link's delay is the same both ways), capped at MAX_LINK_DELAY_S."""
    delays: dict[tuple[NodeID, NodeID], float] = {}
    for r in snapshot.peers.values():
        for other, link in r.links.items():
            delays[(NodeID(r.peer_id), NodeID(other))] = min(link.rtt_s / 2, MAX_LINK_DELAY_S)
    return delays


def route_deprioritising_bans(
    router: Router,
    view: RoutingView,
    start_layer: int,
    prev: NodeID,
    session_tokens: int,
    others_open: int | None = None,
) -> Route:
    """`router`'s route from `start_layer`; if its bans leave some layer with no usable holder, the fastest
    route that goes through banned peers only where nobody else holds the layers. The router's NoRouteError
    (naming the layers) when even banned peers do not cover them."""
    try:
        return router.route_from(view, start_layer, prev, session_tokens, others_open)
    except NoRouteError:
        route = _through_banned(router, view, start_layer, session_tokens)
        if route is None:
            raise
        return route


def _through_banned(router: Router, view: RoutingView, start_layer: int, session_tokens: int) -> Route | None:
    banned = {p for p in view.peers if router.bans is not None and router.bans.is_banned(p)}
    if not banned:
        return None
    default_s = router.config.default_latency_s
    penalised = RoutingView.of(
        view.num_layers,
        (
            replace(p, latency_s=max(p.latency_s, default_s) + BANNED_HOP_PENALTY_S)
            if p.peer_id in banned
            else p
            for p in view.peers.values()
        ),
        view.links_s,
    )
    unbanned = Router(None, config=RoutingConfig(default_latency_s=default_s))  # no bans: they are costs here
    try:
        route = unbanned.fastest_path(penalised, start_layer, session_tokens)
    except NoRouteError:
        return None
    used = [str(s.peer_id)[-8:] for s in route if s.peer_id in banned]
    logger.warning(
        "only banned peers hold some layers: routing through %s anyway (%s)", used, route_text(route)
    )
    return route


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
        min_reporters: int = MIN_REPORTERS,
        max_layer_tokens_s: float = MAX_LAYER_TOKENS_S,
        rng: random.Random | None = None,
        ping: Pinger | None = None,
        ping_timeout_s: float = 1.0,
        quant: str = "none",
    ) -> None:
        self._read_snapshot = snapshot
        self.quant = quant  # routes go through peers holding their layers so only (ClientConfig.quant)
        self._ping = ping  # measures this client's round trip to a peer (None: client delays unmeasured)
        self.ping_timeout_s = ping_timeout_s
        self.rng = rng  # random IWRR start phases, so many clients' first sessions spread over replicas
        self.num_layers = num_layers
        self.cache_high_water = cache_high_water
        self.snapshot_max_age_s = snapshot_max_age_s
        self.bans = BanList(clock, bans)
        self._clock = clock
        self._snapshot: SwarmSnapshot | None = None
        self._read_at = -float("inf")
        self.min_reporters = min_reporters
        self.max_layer_tokens_s = max_layer_tokens_s
        self.ratios: dict[NodeID, float] = {}  # observed / announced speed per timed peer, running average
        self.withdrawn: dict[NodeID, float] = {}  # peers seen dead -> their record's updated_at then
        # set by a death: the next route may use the cached snapshot, however old (see `withdraw`)
        self._reuse_snapshot = False
        self._router: Router | None = None
        self._router_key: tuple[object, ...] | None = None  # (epoch, flow factors) the router was built for
        self._decode_router: Router | None = None  # over the plan's decode flows (decode_route)
        self._lock = asyncio.Lock()  # one DHT read at a time; concurrent sessions share its result
        self.open_sessions: set[str] = set()  # sessions of this client that hold a route (see `route`)
        self.client_rtt_s: dict[NodeID, float] = {}  # round trips this client measured to peers
        self._pinged_at: dict[NodeID, float] = {}  # when each peer was last pinged (answered or not)

    async def snapshot(self, force: bool = False) -> SwarmSnapshot:
        async with self._lock:
            stale = self._clock() - self._read_at > self.snapshot_max_age_s
            if force or stale or self._snapshot is None:
                self._snapshot = await self._read_snapshot()
                self._read_at = self._clock()
                self._forget_revived(self._snapshot)
            return self._snapshot

    def withdraw(self, peer_id: NodeID) -> None:
        """`peer_id` was seen dead: route nothing through it until its record is refreshed after now."""
        record = self._snapshot.peers.get(peer_id) if self._snapshot is not None else None
        self.withdrawn[peer_id] = record.updated_at if record is not None else -math.inf
        # A DHT read right after a death can stall for hivemind's RPC timeout (~3 s) on the dead peer's own
        # DHT node; the cached snapshot less the dead peer is good enough for its replacement (a route that
        # fails on it is retried on a fresh read anyway).
        self._reuse_snapshot = True
        logger.warning("peer %s seen dead: withdrawn from routing until it announces again", peer_id[-8:])

    def _forget_revived(self, snapshot: SwarmSnapshot) -> None:
        """Drop withdrawals whose peer has announced since (it was only slow, or came back) or whose record
        is gone (nothing left to route to)."""
        for peer_id, updated_at in list(self.withdrawn.items()):
            record = snapshot.peers.get(peer_id)
            if record is None or record.updated_at > updated_at:
                del self.withdrawn[peer_id]
                if record is not None:
                    logger.info("peer %s announced again: routable", peer_id[-8:])

    def router(self, snapshot: SwarmSnapshot) -> Router:
        """The Router of the snapshot's plan, with flows scaled by observed speeds; rebuilt when the epoch or
        a peer's (coarsened) flow factor changes."""
        epoch = snapshot.plan.epoch if snapshot.plan is not None else None
        factors = self._flow_factors()
        key = (epoch, tuple(sorted(factors.items())))
        if self._router is None or key != self._router_key:
            plan = snapshot.plan.to_plan() if snapshot.plan is not None else None
            if plan is not None and (self._router_key is None or self._router_key[0] != epoch):
                logger.info("routing by plan epoch %d (%s)", plan.epoch, plan.method)
            routed = discount_plan(plan, factors) if plan is not None else None
            self._router, self._router_key = Router(routed, bans=self.bans, rng=self.rng), key
        return self._router

    def observe(self, peer_id: NodeID, layers: int, tokens: int, compute_s: float) -> None:
        """Feed one timed hop: `peer_id` ran `layers` layers on `tokens` tokens in `compute_s` seconds. Its
        running speed ratio (observed / announced) then scales the flow routing sends it."""
        record = self._snapshot.peers.get(peer_id) if self._snapshot is not None else None
        if record is None:
            return
        announced = announced_layer_tokens_s(
            record.decode_layer_tokens_s_b1, record.prefill_layer_tokens_s, tokens, self.max_layer_tokens_s
        )
        ratio = speed_ratio(announced, layers, tokens, compute_s)
        if ratio is None:
            return
        before = self.ratios.get(peer_id, ratio)
        self.ratios[peer_id] = before + OBSERVED_WEIGHT * (ratio - before)

    def _flow_factors(self) -> dict[NodeID, float]:
        """Flow factors below 1, coarsened to powers of two so that noise does not rebuild the router."""
        factors = {}
        for peer_id, ratio in self.ratios.items():
            factor = flow_factor(ratio)
            if factor < 1.0:
                factors[peer_id] = 2.0 ** round(math.log2(factor))
        return factors

    async def route(
        self,
        start_layer: int,
        prev: NodeID,
        session_tokens: int,
        avoid: frozenset[NodeID] = frozenset(),
        session_id: str = "",
    ) -> Route:
        """A route (or its tail from `start_layer`, after peer `prev`) that never goes through a peer in
        `avoid`; NoRouteError names missing layers. With `session_id`, the route weighs latency against the
        plan's flows by how many other sessions of this client are open (swarm.routing.route): the session
        counts as open until `release`.

        A failure on a cached snapshot is retried on a fresh one (peers may have joined since), and only then
        through banned peers (see route_deprioritising_bans). Right after a peer was withdrawn, the cached
        snapshot is tried first however old it is (see `withdraw`).
        """
        reuse, self._reuse_snapshot = self._reuse_snapshot, False
        cached = self._snapshot if reuse and self._snapshot is not None else await self.snapshot()
        others = None
        if session_id:
            others = len(self.open_sessions - {session_id})
            self.open_sessions.add(session_id)
            await self.measure_client_links(cached)
        try:
            return self._route(cached, start_layer, prev, session_tokens, avoid, others)
        except NoRouteError:
            snapshot = await self.snapshot(force=True)
            return self._route(snapshot, start_layer, prev, session_tokens, avoid, others, True)

    async def measure_client_links(self, snapshot: SwarmSnapshot) -> None:
        """Ping, twice each, the serving peers a route may start or end on (those holding the first or the last
        layer) whose round trip from this client is not known yet; a peer that does not answer within
        ping_timeout_s stays unmeasured (routing then assumes the default delay) for PING_RETRY_S."""
        if self._ping is None:
            return
        ping, now = self._ping, self._clock()
        live = snapshot.peers  # forget peers that left: a long-running client meets many
        self.client_rtt_s = {p: r for p, r in self.client_rtt_s.items() if p in live}
        self._pinged_at = {p: t for p, t in self._pinged_at.items() if p in live}
        ends = [
            NodeID(r.peer_id)
            for r in snapshot.serving().values()
            if (r.range_start == 0 or r.range_end == self.num_layers)
            and NodeID(r.peer_id) not in self.client_rtt_s
            and now - self._pinged_at.get(NodeID(r.peer_id), -math.inf) >= PING_RETRY_S
        ][:MAX_PINGS]
        if not ends:
            return
        self._pinged_at.update((p, now) for p in ends)

        async def one(peer_id: NodeID) -> None:
            try:
                async with asyncio.timeout(self.ping_timeout_s):
                    first = await ping(peer_id)  # may include dialling the peer: the second is the link's
                    self.client_rtt_s[peer_id] = min(first, await ping(peer_id))
            except Exception as e:  # unmeasured is a fine answer: the route assumes the default delay
                logger.debug("no round trip to %s: %r", peer_id[-8:], e)

        await asyncio.gather(*(one(p) for p in ends))

    def release(self, session_id: str) -> None:
        """`session_id` closed: it no longer counts as open when routing the others."""
        self.open_sessions.discard(session_id)

    async def decode_route(self, session_tokens: int, avoid: frozenset[NodeID] = frozenset()) -> Route | None:
        """The route to decode on after the prompt, by IWRR over the plan's decode flows (Plan.decode_flows); None
        when the plan has none (one flow serves both phases) or they reach no usable route. From the cached
        snapshot however old (the session's route read it just before its prompt): no DHT read between the
        first token and the second."""
        snapshot = self._snapshot or await self.snapshot()
        plan = snapshot.plan.to_plan() if snapshot.plan is not None else None
        if plan is None or not plan.decode_flows:
            return None
        if (
            self._decode_router is None
            or self._decode_router.plan is None
            or (self._decode_router.plan.epoch != plan.epoch)
        ):
            decode = replace(plan, flows=plan.decode_flows, decode_flows=())
            # no latency fallback: a decode route off the decode flows is no reason to move
            config = RoutingConfig(fallback_to_latency=False)
            self._decode_router = Router(decode, bans=self.bans, config=config, rng=self.rng)
        view = self._view(snapshot, self.cache_high_water, avoid)
        try:
            return self._decode_router.route_from(view, 0, SOURCE, session_tokens)
        except NoRouteError as error:
            logger.info("no decode route (%s): decoding where the prompt went", error)
            return None

    def _route(
        self,
        snapshot: SwarmSnapshot,
        start_layer: int,
        prev: NodeID,
        session_tokens: int,
        avoid: frozenset[NodeID],
        others_open: int | None,
        through_banned: bool = False,
    ) -> Route:
        view = self._view(snapshot, self.cache_high_water, avoid)
        router = self.router(snapshot)
        if through_banned:
            return route_deprioritising_bans(router, view, start_layer, prev, session_tokens, others_open)
        return router.route_from(view, start_layer, prev, session_tokens, others_open)

    def _view(
        self, snapshot: SwarmSnapshot, cache_high_water: float, avoid: frozenset[NodeID] = frozenset()
    ) -> RoutingView:
        unlike = {NodeID(p) for p, r in snapshot.peers.items() if r.quant != self.quant}
        return routing_view(
            snapshot,
            self.num_layers,
            cache_high_water,
            avoid | unlike,
            min_reporters=self.min_reporters,
            max_layer_tokens_s=self.max_layer_tokens_s,
            ratios=self.ratios,
            withdrawn=self.withdrawn,
            client_rtt_s=self.client_rtt_s,
        )

    async def holders(self, layers: LayerRange, like: NodeID | None = None) -> list[NodeID]:
        """Serving, unbanned peers that hold all of `layers` (the candidates to spot-check a stage); with
        `like`, only those whose records say they hold their weights as it does (the same --quant: a peer
        holding them otherwise computes other numbers, honestly).

        From the cached snapshot however old (sessions refresh it when they open): a spot-check runs between
        two decode steps, and a DHT read there can stall the answer for seconds while a dead peer's DHT node
        is still in the table; a checker that has gone only makes the check skip."""
        snapshot = self._snapshot or await self.snapshot()
        view = self._view(snapshot, 1.0)

        def quant(peer_id: NodeID) -> str:
            record = snapshot.peers.get(peer_id)
            return record.quant if record is not None else "none"

        return [
            p
            for p, state in view.peers.items()
            if state.layers.covers(layers)
            and not self.bans.is_banned(p)
            and (like is None or quant(p) == quant(like))
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

    def record(self, peer_id: NodeID) -> PeerRecord | None:
        """What ``peer_id`` announced, as of the latest snapshot."""
        return self._snapshot.peers.get(peer_id) if self._snapshot is not None else None

    async def wait_for_coverage(self, timeout_s: float) -> SwarmSnapshot:
        """Poll the DHT until serving peers cover every layer; NoRouteError naming the gaps at the deadline."""
        deadline = self._clock() + timeout_s
        while True:
            snapshot = await self.snapshot(force=True)
            view = self._view(snapshot, 1.0)
            counts = coverage((p.layers for p in view.peers.values()), self.num_layers)
            missing = [layer for layer, count in enumerate(counts) if count == 0]
            if not missing:
                await self.measure_client_links(snapshot)  # now, so that sessions need not wait for it
                return snapshot
            if self._clock() >= deadline:
                others = sorted({r.quant for r in snapshot.peers.values()} - {self.quant})
                if others:
                    logger.warning(
                        "peers holding layers as %s are not used: this client routes through --quant %s only",
                        "/".join(others),
                        self.quant,
                    )
                raise NoRouteError(missing)
            await asyncio.sleep(0.5)
