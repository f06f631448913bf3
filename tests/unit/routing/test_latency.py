"""Routes that weigh latency: a lone session takes the fastest route, many sessions spread by the plan's flows,
and in the 4-peer layout with a 10x slower link at most a tenth of the sessions cross it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.planner import solve
from swarm.planner.cluster import Cluster
from swarm.planner.synthetic import slow_link_layout
from swarm.routing import PeerState, Router, RoutingView, Stage
from swarm.routing.route import Route, RoutingConfig, crosses, link_session_share
from swarm.types import SINK, SOURCE, EdgeFlow, LayerRange, NodeID, Plan

pytestmark = pytest.mark.timeout(60)

N = NodeID
HALVES = {"p1": (0, 15), "p2": (0, 15), "p3": (15, 30), "p4": (15, 30)}
COMPUTE_S_PER_LAYER = 0.0025  # decode at batch 1: 400 tokens/s through one layer


def view_of(cluster: Cluster, placement: dict[NodeID, LayerRange], order_seed: int = 0) -> RoutingView:
    """The layout as a client sees it: client links from the cluster's source links, peer links announced."""
    peers = [
        PeerState(
            n,
            r,
            10_000,
            latency_s=cluster.link_by_pair[(SOURCE, n)].latency_s,
            compute_s_per_layer=COMPUTE_S_PER_LAYER,
        )
        for n, r in placement.items()
    ]
    links = [(lk.src, lk.dst, lk.latency_s) for lk in cluster.links if SOURCE != lk.src and lk.dst != SINK]
    rng = random.Random(order_seed)  # the order peers and links are listed in must not matter
    rng.shuffle(peers)
    rng.shuffle(links)
    return RoutingView.of(cluster.model.num_layers, peers, {(a, b): s for a, b, s in links})


def blind_plan(names: dict[str, str]) -> Plan:
    """A plan that ignores latency: a quarter of the flow on each of the four crossings, the slow one too."""
    p1, p2, p3, p4 = (N(names[k]) for k in ("p1", "p2", "p3", "p4"))
    flows = [(SOURCE, p1, 2.0), (SOURCE, p2, 2.0), (p3, SINK, 2.0), (p4, SINK, 2.0)]
    flows += [(a, b, 1.0) for a in (p1, p2) for b in (p3, p4)]
    return Plan(
        method="blind",
        placement={N(names[k]): LayerRange(*r) for k, r in HALVES.items()},
        max_flow_tokens_s=4.0,
        flows=tuple(EdgeFlow(s, d, f) for s, d, f in flows),
    )


def crossings(routes: list[Route]) -> Counter[tuple[NodeID, NodeID]]:
    counts: Counter[tuple[NodeID, NodeID]] = Counter()
    for route in routes:
        hops = [SOURCE, *(s.peer_id for s in route), SINK]
        counts.update(zip(hops, hops[1:], strict=False))
    return counts


def concurrent_rounds(router: Router, view: RoutingView, sessions: int, rounds: int) -> list[Route]:
    """`rounds` times: open `sessions` sessions one after another while the earlier ones stay open."""
    return [router.build(view, 100, others_open=k) for _ in range(rounds) for k in range(sessions)]


@settings(max_examples=30, deadline=None)
@given(names=st.permutations(["a", "b", "c", "d"]), order_seed=st.integers(0, 1000), phases=st.booleans())
def test_a_lone_session_never_takes_the_slow_link(names: list[str], order_seed: int, phases: bool) -> None:
    roles = dict(zip(("p1", "p2", "p3", "p4"), names, strict=True))
    cluster, slow = slow_link_layout((roles["p1"], roles["p2"], roles["p3"], roles["p4"]))
    plan = blind_plan(roles)
    router = Router(plan, rng=random.Random(order_seed) if phases else None)
    view = view_of(cluster, dict(plan.placement), order_seed)
    routes = [router.build(view, 100, others_open=0) for _ in range(60)]
    counts = crossings(routes)
    assert counts[slow] == 0
    # The three fast crossings tie: lone sessions still spread over them by the plan's flows.
    fast = [(N(roles[a]), N(roles[b])) for a, b in (("p1", "p4"), ("p2", "p3"), ("p2", "p4"))]
    assert all(counts[c] >= 10 for c in fast), counts


def test_without_others_open_routes_go_by_flow_alone() -> None:
    roles = {k: k for k in HALVES}
    cluster, slow = slow_link_layout()
    plan = blind_plan(roles)
    router = Router(plan)
    view = view_of(cluster, dict(plan.placement))
    routes = [router.build(view, 100) for _ in range(400)]
    assert crossings(routes)[slow] == pytest.approx(100, abs=2)  # a quarter, as the plan says


def test_many_open_sessions_spread_by_the_plans_flows() -> None:
    cluster, slow = slow_link_layout()
    plan = blind_plan({k: k for k in HALVES})
    router = Router(plan)
    view = view_of(cluster, dict(plan.placement))
    # A client with 7 sessions open: its next ones go by the flows, the slow crossing included.
    routes = [router.build(view, 100, others_open=7) for _ in range(400)]
    counts = crossings(routes)
    for f in plan.flows:
        assert counts[(f.src, f.dst)] / 400 == pytest.approx(f.tokens_s / plan.max_flow_tokens_s, abs=0.01)
    # 8 sessions opened together: all but the first of each round may cross the slow link, at its share.
    routes = concurrent_rounds(Router(plan), view, 8, 50)
    assert crossings(routes[::8])[slow] == 0  # the first of each round was alone
    assert 0.15 <= crossings(routes)[slow] / len(routes) <= 0.25 + 0.01


def test_in_the_slow_link_layout_at_most_a_tenth_of_sessions_cross_the_slow_link() -> None:
    cluster, slow = slow_link_layout()
    plan = solve(cluster, "milp", time_limit_s=5.0)
    view = view_of(cluster, dict(plan.placement))
    for sessions in (1, 8):
        routes = concurrent_rounds(Router(plan, rng=random.Random(sessions)), view, sessions, 40)
        assert link_session_share(routes, *slow) <= 0.1  # slow_link_session_share
        assert link_session_share(routes, *slow) == crossings(routes)[slow] / len(routes)


def test_failover_from_a_peer_weighs_its_own_links() -> None:
    cluster, slow = slow_link_layout()
    plan = blind_plan({k: k for k in HALVES})
    router = Router(plan)
    view = view_of(cluster, dict(plan.placement))
    tails = [router.route_from(view, 15, N("p1"), 100, others_open=0) for _ in range(20)]
    assert {t[0].peer_id for t in tails} == {N("p4")}  # p1 -> p3 is the slow link


def test_delays_default_where_unmeasured_and_a_link_counts_both_ways() -> None:
    router = Router(None, config=RoutingConfig(default_latency_s=0.04))
    a = PeerState(N("a"), LayerRange(0, 2), 100, latency_s=0.01)
    b = PeerState(N("b"), LayerRange(2, 4), 100)
    view = RoutingView.of(4, [a, b], {(N("a"), N("b")): 0.03})
    assert router.delay_s(view, SOURCE, N("a")) == 0.01
    assert router.delay_s(view, N("b"), SINK) == 0.04
    assert router.delay_s(view, N("a"), N("b")) == 0.03
    assert router.delay_s(view, N("b"), N("a")) == 0.03
    assert router.delay_s(RoutingView.of(4, [a, b]), N("a"), N("b")) == 0.04


def test_crosses_names_consecutive_stages_and_the_client_ends() -> None:
    route = (Stage(N("a"), LayerRange(0, 2)), Stage(N("b"), LayerRange(2, 4)))
    assert crosses(route, N("a"), N("b")) and crosses(route, SOURCE, N("a")) and crosses(route, N("b"), SINK)
    assert not crosses(route, N("b"), N("a")) and not crosses(route, SOURCE, N("b"))
    assert link_session_share([route, route[:1]], N("a"), N("b")) == 0.5
    assert link_session_share([], N("a"), N("b")) == 0.0
