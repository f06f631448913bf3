"""Per-request routes: which peer runs which layers, chosen by IWRR over the plan's edge flows.

A route is built stage by stage from the source (the client's embeddings). At node u, which has finished
layers up to `done`, the candidates are the plan's nodes v on valid edges u -> v (v.start <= done < v.end),
weighted by the flow the plan sends along u -> v; one IWRR per node turns those flows into a smooth,
deterministic sequence of choices, so over many requests every edge carries its share of the plan's flow.
With partial overlaps the next stage runs only the layers not yet done: [done, v.end).

Latency. A client that says how many of its other sessions are open (`others_open`) also weighs each
candidate's latency: the least time a token takes from here to the client's head through it, summing link
delays (client -> first peer and last peer -> client from PeerState.latency_s; peer -> peer from the view's
announced links) and compute, over the plan's edges onward. Candidates slower than the fastest by more than
a tie margin plus `latency_slack_per_session` times the fastest for each other open session are masked
for this pick (IWRR gives them their turn virtually, so the rest keep their proportions). A lone session
thus takes the fastest route (near-ties still spread by IWRR); a client with many sessions open admits
ever slower routes and spreads by the plan's flows: its sessions hide each other's trips, so a slow route
costs it less, while the flows are what the swarm's capacity is. Without `others_open` (the simulator,
tests of proportions) routes go by flow alone.

Candidates that cannot take the session right now are masked for that pick only: peers missing from the live
view, banned after a failure, holding other layers than the plan says, or with less free KV cache than the
session needs. When the plan gives nothing usable (no plan yet, or its peers are all gone or masked) the rest
of the route is the lowest-latency path over the live announcements (Dijkstra over layer boundaries, cost =
hop latency + compute estimate, as Petals does). If no usable peer serves some layer, NoRouteError names it.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.errors import NoRouteError
from swarm.routing.bans import BanList
from swarm.routing.iwrr import IWRR
from swarm.types import SINK, SOURCE, LayerRange, NodeID, Plan, coverage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerState:
    """What routing needs to know about one live peer, from its latest DHT announcement."""

    peer_id: NodeID
    layers: LayerRange  # the layers the peer actually holds now
    free_cache_tokens: int  # KV cache tokens the peer can still give to new sessions
    latency_s: float = 0.0  # one-way delay between the client and this peer, seconds (0: unmeasured)
    compute_s_per_layer: float = 0.0  # estimated time for one layer of one decode step, seconds
    cache_high_water_tokens: int = 0  # tokens of free cache the peer keeps back (it refuses sessions beyond)


@dataclass(frozen=True)
class RoutingView:
    """A snapshot of the live swarm as the client sees it. `peers` may be a live mapping (the simulator's)."""

    num_layers: int
    peers: Mapping[NodeID, PeerState]
    links_s: Mapping[tuple[NodeID, NodeID], float] = field(default_factory=dict)  # one-way delay src -> dst

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")

    @classmethod
    def of(
        cls,
        num_layers: int,
        peers: Iterable[PeerState],
        links_s: Mapping[tuple[NodeID, NodeID], float] | None = None,
    ) -> RoutingView:
        return cls(num_layers, {p.peer_id: p for p in peers}, links_s or {})


@dataclass(frozen=True)
class Stage:
    """One hop of a route: `peer_id` runs `layers`."""

    peer_id: NodeID
    layers: LayerRange


Route = tuple[Stage, ...]


@dataclass(frozen=True)
class RoutingConfig:
    """How routes are chosen."""

    fallback_to_latency: bool = True  # when the plan has nothing usable, route over live peers by latency
    default_latency_s: float = 0.05  # assumed hop latency for peers with no measurement, seconds
    latency_tie_fraction: float = 0.1  # routes within this fraction of the fastest one count as fast
    latency_slack_per_session: float = 1.0  # each other open session admits routes slower by this x fastest


def route_text(route: Route) -> str:
    """'0:10 via a1b2c3 -> 10:30 via d4e5f6', for logs."""
    return " -> ".join(f"{s.layers} via {str(s.peer_id)[-6:]}" for s in route)


def crosses(route: Route, src: NodeID, dst: NodeID) -> bool:
    """Does `route` send hidden states over the link src -> dst (src's stage right before dst's)? SOURCE and
    SINK name the client: crosses(route, SOURCE, p) when p runs the first stage."""
    hops = [SOURCE, *(s.peer_id for s in route), SINK]
    return any((a, b) == (src, dst) for a, b in zip(hops, hops[1:], strict=False))


def link_session_share(routes: Sequence[Route], src: NodeID, dst: NodeID) -> float:
    """The fraction of `routes` (one per session) that cross the link src -> dst; 0 for no routes."""
    return sum(crosses(r, src, dst) for r in routes) / len(routes) if routes else 0.0


def check_route(route: Route, num_layers: int) -> None:
    """Raise ValueError unless the route covers layers [0, num_layers) exactly once, in order."""
    done = 0
    for stage in route:
        if stage.layers.start != done:
            raise ValueError(f"route {route_text(route)} runs {stage.layers} after layer {done}")
        done = stage.layers.end
    if done != num_layers:
        raise ValueError(f"route {route_text(route)} ends at layer {done}, the model has {num_layers}")


class Router:
    """Builds routes from one plan. Keeps one IWRR per plan node, so consecutive routes interleave smoothly.

    A subclass may pick among a hop's candidates another way by overriding `_choose` (the simulator's
    baseline schedulers draw at random).
    """

    def __init__(
        self,
        plan: Plan | None,
        *,
        bans: BanList | None = None,
        config: RoutingConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.plan = plan
        self.rng = rng  # random start phases for the IWRRs (see IWRR); None: deterministic
        self.bans = bans
        self.config = config or RoutingConfig()
        self._placement: dict[NodeID, LayerRange] = dict(plan.placement) if plan else {}
        self._inflow: dict[NodeID, float] = {}
        self._by_node: dict[NodeID, IWRR[NodeID]] = {}
        self._by_layer: dict[int, IWRR[NodeID] | None] = {}
        if plan is not None:
            self._build_node_iwrrs(plan)

    def _build_node_iwrrs(self, plan: Plan) -> None:
        out: dict[NodeID, list[tuple[NodeID, float]]] = {}
        for f in plan.flows:
            dst_range = self._placement.get(f.dst)
            if f.tokens_s <= 0 or dst_range is None:
                continue  # flows into the sink need no choice: the route simply ends
            src_end = 0 if f.src == SOURCE else self._end_of(f.src)
            if src_end is None or not (dst_range.start <= src_end < dst_range.end):
                logger.warning(
                    "plan epoch %d: ignoring flow on invalid edge %s -> %s", plan.epoch, f.src, f.dst
                )
                continue
            out.setdefault(f.src, []).append((f.dst, f.tokens_s))
            self._inflow[f.dst] = self._inflow.get(f.dst, 0.0) + f.tokens_s
        for node, edges in out.items():
            edges.sort()  # a fixed candidate order keeps the picks deterministic whatever the flows' order
            self._by_node[node] = IWRR([d for d, _ in edges], [w for _, w in edges], self.rng)

    def _end_of(self, node: NodeID) -> int | None:
        r = self._placement.get(node)
        return r.end if r is not None else None

    # -- masking ---------------------------------------------------------------------------------------

    def usable(self, view: RoutingView, peer: NodeID, needed: LayerRange, session_tokens: int) -> bool:
        """Can `peer` run `needed` for a new session of `session_tokens` tokens right now?"""
        state = view.peers.get(peer)
        return state is not None and state.layers.covers(needed) and self._usable_state(state, session_tokens)

    # -- building routes -------------------------------------------------------------------------------

    def build(self, view: RoutingView, session_tokens: int = 0, others_open: int | None = None) -> Route:
        """A route over all layers for a new session that will hold up to `session_tokens` tokens;
        `others_open`: the client's other open sessions, to weigh latency (None: by flow alone)."""
        return self.route_from(view, 0, SOURCE, session_tokens, others_open)

    def route_from(
        self,
        view: RoutingView,
        start_layer: int,
        prev: NodeID = SOURCE,
        session_tokens: int = 0,
        others_open: int | None = None,
    ) -> Route:
        """The rest of a route from `start_layer`, after node `prev` (failover: prev is the last good stage's
        peer, or SOURCE). Ban the failed peer first so it is skipped. `others_open` as in `build`."""
        if not 0 <= start_layer < view.num_layers:
            raise ValueError(f"start_layer {start_layer} is outside the model's {view.num_layers} layers")
        stages: list[Stage] = []
        node, done = prev, start_layer
        while done < view.num_layers:
            nxt = self._pick_next(view, node, done, session_tokens, others_open)
            if nxt is None:
                if not self.config.fallback_to_latency:
                    raise self._no_route(view, done, session_tokens)
                stages.extend(self.fastest_path(view, done, session_tokens))
                break
            end = self._placement[nxt].end
            stages.append(Stage(nxt, LayerRange(done, end)))
            node, done = nxt, end
        return tuple(stages)

    def _candidates(self, node: NodeID, done: int) -> IWRR[NodeID] | None:
        at_plan_boundary = node == SOURCE if done == 0 else self._end_of(node) == done
        iwrr = self._by_node.get(node) if at_plan_boundary else None
        # Off the plan's edges (failover mid-stage, or a node without outgoing flow): any plan node holding
        # `done`, weighted by the flow the plan sends into it.
        return iwrr if iwrr is not None else self._layer_iwrr(done)

    def _pick_next(
        self, view: RoutingView, node: NodeID, done: int, session_tokens: int, others_open: int | None
    ) -> NodeID | None:
        iwrr = self._candidates(node, done)
        if iwrr is None:
            return None
        to_go: dict[tuple[NodeID, int], float] = {}

        def time_to_go(v: NodeID, start: int) -> float:
            # The least time from v's input to the client's head over usable plan edges; inf when v is not
            # usable now or no usable chain continues from it to the last layer: looking ahead keeps a pick
            # from leading into a dead end (e.g. a successor whose cache is full).
            key = (v, start)
            if key not in to_go:
                end = self._placement[v].end
                best = float("inf")
                if self.usable(view, v, LayerRange(start, end), session_tokens):
                    here = (end - start) * view.peers[v].compute_s_per_layer
                    if end >= view.num_layers:
                        best = here + self.delay_s(view, v, SINK)
                    elif (nxt := self._candidates(v, end)) is not None:
                        onward = (self.delay_s(view, v, w) + time_to_go(w, end) for w in nxt.candidates)
                        best = here + min(onward, default=float("inf"))
                to_go[key] = best
            return to_go[key]

        times = {v: self.delay_s(view, node, v) + time_to_go(v, done) for v in iwrr.candidates}
        limit = float("inf")
        if others_open is not None:
            fastest = min(times.values())
            margin = self.config.latency_tie_fraction + self.config.latency_slack_per_session * others_open
            limit = fastest * (1.0 + margin)
        return self._choose(iwrr, lambda v: not (times[v] < float("inf") and times[v] <= limit))

    def delay_s(self, view: RoutingView, src: NodeID, dst: NodeID) -> float:
        """One-way delay of the hop src -> dst: the client's to or from a peer (PeerState.latency_s), else the
        view's announced link (either direction's, as a link's delay is the same both ways); the configured
        default where unmeasured."""
        if src == SOURCE or dst == SINK:
            state = view.peers.get(dst if src == SOURCE else src)
            measured = state.latency_s if state is not None else 0.0
        else:
            measured = view.links_s.get((src, dst)) or view.links_s.get((dst, src)) or 0.0
        return measured if measured > 0 else self.config.default_latency_s

    def _choose(self, iwrr: IWRR[NodeID], masked: Callable[[NodeID], bool]) -> NodeID | None:
        """The next of `iwrr`'s candidates that is not masked, or None when all are."""
        return iwrr.pick(masked)

    def _layer_iwrr(self, layer: int) -> IWRR[NodeID] | None:
        if layer not in self._by_layer:
            holders = sorted(
                n for n, r in self._placement.items() if layer in r and self._inflow.get(n, 0) > 0
            )
            self._by_layer[layer] = (
                IWRR(holders, [self._inflow[n] for n in holders], self.rng) if holders else None
            )
        return self._by_layer[layer]

    def fastest_path(self, view: RoutingView, start_layer: int, session_tokens: int = 0) -> Route:
        """Lowest-cost route over live usable peers from `start_layer` to the last layer.

        Nodes are layer boundaries; from boundary b a peer holding b can take the hidden states to its own end
        or to any boundary in between where another peer starts. Cost = hop latency + layers * compute time.
        """
        n = view.num_layers
        peers = sorted(
            (p for p in view.peers.values() if p.layers.end > start_layer and p.layers.start < n),
            key=lambda p: (p.layers.start, p.peer_id),
        )
        peers = [p for p in peers if self._usable_state(p, session_tokens)]
        bounds = sorted({start_layer, n} | {p.layers.start for p in peers if p.layers.start > start_layer})
        best: dict[int, float] = {start_layer: 0.0}
        back: dict[int, tuple[int, NodeID]] = {}
        heap: list[tuple[float, int]] = [(0.0, start_layer)]
        while heap:
            cost, b = heapq.heappop(heap)
            if b == n:
                break
            if cost > best.get(b, float("inf")):
                continue
            for p in peers:
                if p.layers.start > b:
                    break  # sorted by start: nobody later holds b
                if p.layers.end <= b:
                    continue
                end = min(p.layers.end, n)
                hop_s = p.latency_s if p.latency_s > 0 else self.config.default_latency_s
                lo, hi = bisect.bisect_right(bounds, b), bisect.bisect_right(bounds, end)
                for e in {*bounds[lo:hi], end}:
                    c = cost + hop_s + (e - b) * p.compute_s_per_layer
                    if c < best.get(e, float("inf")):
                        best[e], back[e] = c, (b, p.peer_id)
                        heapq.heappush(heap, (c, e))
        if n not in best:
            raise self._no_route(view, start_layer, session_tokens)
        stages: list[Stage] = []
        e = n
        while e != start_layer:
            b, peer = back[e]
            if stages and stages[-1].peer_id == peer:  # two hops on one peer are one stage
                stages[-1] = Stage(peer, LayerRange(b, stages[-1].layers.end))
            else:
                stages.append(Stage(peer, LayerRange(b, e)))
            e = b
        return tuple(reversed(stages))

    def _usable_state(self, p: PeerState, session_tokens: int) -> bool:
        """Room for a session of `session_tokens` above the high-water mark, and not banned."""
        if p.free_cache_tokens - p.cache_high_water_tokens < session_tokens:
            return False
        return self.bans is None or not self.bans.is_banned(p.peer_id)

    def _no_route(self, view: RoutingView, start_layer: int, session_tokens: int) -> NoRouteError:
        missing = self._uncovered(view, start_layer, session_tokens)
        if not missing:  # every layer has a usable holder, but the plan's edges do not join them up
            return NoRouteError([start_layer], f"the plan has no usable peer for layer {start_layer}")
        text = str(NoRouteError(missing))
        return NoRouteError(
            missing, f"{text} (counting live, unbanned peers with {session_tokens} free cache tokens)"
        )

    def _uncovered(self, view: RoutingView, start_layer: int, session_tokens: int) -> list[int]:
        """Layers in [start_layer, num_layers) that no usable live peer holds."""
        usable = (p.layers for p in view.peers.values() if self._usable_state(p, session_tokens))
        counts = coverage(usable, view.num_layers)
        return [layer for layer in range(start_layer, view.num_layers) if counts[layer] == 0]
