"""Router: flow proportions, overlaps, masking, bans, latency fallback, failover and no-route errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarm.errors import NoRouteError
from swarm.routing import BanList, PeerState, Router, RoutingConfig, RoutingView, Stage, check_route
from swarm.types import SINK, SOURCE, EdgeFlow, LayerRange, NodeID, Plan

pytestmark = pytest.mark.timeout(30)

N = NodeID


def make_plan(placement: dict[str, tuple[int, int]], flows: list[tuple[str, str, float]]) -> Plan:
    return Plan(
        method="test",
        placement={N(n): LayerRange(*r) for n, r in placement.items()},
        max_flow_tokens_s=sum(f for s, _, f in flows if s == SOURCE),
        flows=tuple(EdgeFlow(N(s), N(d), f) for s, d, f in flows),
    )


def make_view(num_layers: int, plan: Plan, free: int = 10_000, **overrides: PeerState) -> RoutingView:
    peers = {n: PeerState(n, r, free, latency_s=0.01) for n, r in plan.placement.items()}
    peers.update({N(k): v for k, v in overrides.items()})
    order = sorted(peers)
    random.Random(len(order)).shuffle(order)  # the order peers are listed in must not matter
    return RoutingView(num_layers, {n: peers[n] for n in order})


# a, b hold 0:4 and 0:2; c, d hold 2:6 and 3:6: routes a->c, a->d, b->c with partial overlaps.
OVERLAP = make_plan(
    {"a": (0, 4), "b": (0, 2), "c": (2, 6), "d": (3, 6)},
    [
        (SOURCE, "a", 3.0),
        (SOURCE, "b", 1.0),
        ("a", "c", 1.0),
        ("a", "d", 2.0),
        ("b", "c", 1.0),
        ("c", SINK, 2.0),
        ("d", SINK, 2.0),
    ],
)


def edge_counts(routes: list[tuple[Stage, ...]]) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for route in routes:
        hops = [SOURCE, *(s.peer_id for s in route), SINK]
        counts.update(zip(hops, hops[1:], strict=False))
    return counts


def test_edge_counts_match_flow_proportions_over_10000_routes() -> None:
    router = Router(OVERLAP)
    view = make_view(6, OVERLAP)
    routes = [router.build(view, session_tokens=100) for _ in range(10_000)]
    counts = edge_counts(routes)
    total_flow = OVERLAP.max_flow_tokens_s
    for f in OVERLAP.flows:
        share = counts[(f.src, f.dst)] / 10_000
        assert abs(share - f.tokens_s / total_flow) <= 0.02 * f.tokens_s / total_flow, (f, share)
    # Smooth: the source never sends more than ceil(3/1) + 1 routes in a row to a.
    run = longest = 0
    for route in routes:
        run = run + 1 if route[0].peer_id == "a" else 0
        longest = max(longest, run)
    assert longest <= 4


def test_every_route_covers_every_layer_once_with_partial_overlaps() -> None:
    router = Router(OVERLAP)
    view = make_view(6, OVERLAP)
    seen = set()
    for _ in range(200):
        route = router.build(view)
        check_route(route, 6)
        seen.add(tuple((s.peer_id, str(s.layers)) for s in route))
    assert seen == {
        (("a", "0:4"), ("c", "4:6")),
        (("a", "0:4"), ("d", "4:6")),
        (("b", "0:2"), ("c", "2:6")),
    }


def test_peers_without_enough_free_cache_are_never_chosen() -> None:
    router = Router(OVERLAP)
    view = make_view(6, OVERLAP, d=PeerState(N("d"), LayerRange(3, 6), free_cache_tokens=50))
    routes = [router.build(view, session_tokens=100) for _ in range(1000)]
    assert all(s.peer_id != "d" for r in routes for s in r)
    assert edge_counts(routes)[(N("a"), N("c"))] > 0
    # The high-water mark the peer keeps back counts too.
    view = make_view(6, OVERLAP, c=PeerState(N("c"), LayerRange(2, 6), 150, cache_high_water_tokens=100))
    routes = [router.build(view, session_tokens=100) for _ in range(1000)]
    assert all(s.peer_id != "c" for r in routes for s in r)
    assert all(r[0].peer_id == "a" for r in routes)  # b's only successor is c


def test_banned_peer_is_skipped_until_the_ban_expires() -> None:
    now = [0.0]
    bans = BanList(lambda: now[0])
    router = Router(OVERLAP, bans=bans)
    view = make_view(6, OVERLAP)
    bans.ban(N("a"))
    assert all(router.build(view)[0].peer_id == "b" for _ in range(50))
    now[0] = 1.5
    assert any(router.build(view)[0].peer_id == "a" for _ in range(50))


def test_failover_rebuilds_the_rest_of_the_route() -> None:
    bans = BanList(lambda: 0.0)
    router = Router(OVERLAP, bans=bans)
    view = make_view(6, OVERLAP)
    bans.ban(N("d"))  # d failed while running 4:6 after a
    assert router.route_from(view, 4, prev=N("a")) == (Stage(N("c"), LayerRange(4, 6)),)
    # Off the plan's boundaries (a failed after finishing layer 2 of its 0:4): any holder of layer 3 will do.
    bans.ban(N("a"))
    rest = router.route_from(view, 3, prev=N("b"))
    assert rest[0].layers.start == 3 and rest[-1].layers.end == 6


def test_latency_fallback_without_a_plan() -> None:
    peers = [
        PeerState(N("slow"), LayerRange(0, 6), 1000, latency_s=0.5),
        PeerState(N("x"), LayerRange(0, 3), 1000, latency_s=0.05, compute_s_per_layer=0.001),
        PeerState(N("y"), LayerRange(2, 6), 1000, latency_s=0.05, compute_s_per_layer=0.01),
    ]
    view = RoutingView.of(6, peers)
    route = Router(None).build(view)
    check_route(route, 6)
    assert [s.peer_id for s in route] == ["x", "y"]
    assert route[1].layers == LayerRange(3, 6)


def test_latency_fallback_when_plan_peers_are_gone() -> None:
    view = RoutingView.of(6, [PeerState(N("z"), LayerRange(0, 6), 1000)])
    assert Router(OVERLAP).build(view) == (Stage(N("z"), LayerRange(0, 6)),)
    with pytest.raises(NoRouteError):
        Router(OVERLAP, config=RoutingConfig(fallback_to_latency=False)).build(view)


def test_no_route_error_names_the_missing_layers() -> None:
    view = RoutingView.of(
        10, [PeerState(N("p"), LayerRange(0, 3), 1000), PeerState(N("q"), LayerRange(5, 9), 1000)]
    )
    with pytest.raises(NoRouteError) as info:
        Router(None).build(view)
    assert info.value.missing_layers == [3, 4, 9]
    assert "3:5" in str(info.value) and "9:10" in str(info.value)


def test_bad_input_is_a_clear_error() -> None:
    view = make_view(6, OVERLAP)
    with pytest.raises(ValueError):
        Router(OVERLAP).route_from(view, 6)
    with pytest.raises(ValueError):
        RoutingView(0, {})


# two replicas of each half, equal flows: what a plan gives four equal peers
REPLICAS = make_plan(
    {"a1": (0, 3), "a2": (0, 3), "b1": (3, 6), "b2": (3, 6)},
    [
        (SOURCE, "a1", 2.0),
        (SOURCE, "a2", 2.0),
        *((a, b, 1.0) for a in ("a1", "a2") for b in ("b1", "b2")),
        ("b1", SINK, 2.0),
        ("b2", SINK, 2.0),
    ],
)


def test_many_clients_first_sessions_spread_over_replicas_with_random_phases() -> None:
    view = make_view(6, REPLICAS)
    # Without an rng every client's router starts alike: all their first sessions take the same peers.
    same = {Router(REPLICAS).build(view, session_tokens=100) for _ in range(16)}
    assert len(same) == 1
    firsts = [Router(REPLICAS, rng=random.Random(seed)).build(view, session_tokens=100) for seed in range(64)]
    for stage in (0, 1):
        counts = Counter(route[stage].peer_id for route in firsts)
        assert len(counts) == 2 and min(counts.values()) >= 16, counts
    # the long-run shares are still the plan's flows
    router = Router(OVERLAP, rng=random.Random(7))
    counts = edge_counts([router.build(make_view(6, OVERLAP), session_tokens=100) for _ in range(4000)])
    for f in OVERLAP.flows:
        share = counts[(f.src, f.dst)] / 4000
        assert abs(share - f.tokens_s / OVERLAP.max_flow_tokens_s) <= 0.01, (f, share)
