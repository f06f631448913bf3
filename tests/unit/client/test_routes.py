"""client.routes: DHT snapshots -> routing views -> routes, with KV high-water masking, bans and plan epochs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from client.routes import PING_RETRY_S, SwarmRoutes, routing_view
from swarm.dht import LinkMeasure, PlanRecord, SwarmSnapshot
from swarm.errors import NoRouteError
from swarm.routing import BanConfig, Stage
from swarm.types import SINK, SOURCE, EdgeFlow, LayerRange, NodeID, Plan
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(10)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def snapshot(*records, plan: Plan | None = None) -> SwarmSnapshot:  # type: ignore[no-untyped-def]
    plan_record = (
        PlanRecord(epoch=plan.epoch, planner_peer_id="a", plan=plan.to_json(), created_at=0.0)
        if plan
        else None
    )
    return SwarmSnapshot(
        peers={r.peer_id: r for r in records}, plan=plan_record, planner_peer_id=None, fetched_at=0.0
    )


def make_routes(snapshots: list[SwarmSnapshot], clock: FakeClock) -> tuple[SwarmRoutes, list[int]]:
    reads: list[int] = []

    async def read() -> SwarmSnapshot:
        reads.append(1)
        return snapshots[min(len(reads), len(snapshots)) - 1]

    routes = SwarmRoutes(
        read,
        8,
        cache_high_water=0.9,
        snapshot_max_age_s=2.0,
        bans=BanConfig(base_s=10.0, max_s=60.0),
        clock=clock,
    )
    return routes, reads


def test_peers_past_the_cache_high_water_mark_are_skipped() -> None:
    # b2 has 300 free of 4096: below the 10 % (409 tokens) it keeps back, so it takes no new session
    snap = snapshot(
        peer_record("a", 0, 4),
        peer_record("b", 4, 8, free_cache_tokens=2000),
        peer_record("b2", 4, 8, free_cache_tokens=300),
    )
    routes, _ = make_routes([snap], FakeClock())
    for _ in range(4):
        route = asyncio.run(routes.route(0, SOURCE, 256))
        assert [(s.peer_id, str(s.layers)) for s in route] == [("a", "0:4"), ("b", "4:8")]


def test_only_serving_peers_within_the_model_are_routed() -> None:
    snap = snapshot(peer_record("a", 0, 8, state="loading"), peer_record("b", 0, 8))
    view = routing_view(snap, 8, 0.9)
    assert set(view.peers) == {"b"}


def test_bans_steer_failover_and_missing_layers_are_named() -> None:
    clock = FakeClock()
    routes, reads = make_routes(
        [snapshot(peer_record("a", 0, 4), peer_record("b", 4, 8), peer_record("b2", 4, 8))], clock
    )
    first = asyncio.run(routes.route(0, SOURCE, 16))
    victim = first[1].peer_id
    routes.ban(victim)
    tail = asyncio.run(routes.route(4, first[0].peer_id, 16))
    assert [s.peer_id for s in tail] == [({"b", "b2"} - {victim}).pop()]
    assert len(reads) == 1
    routes.withdraw(tail[0].peer_id)  # seen dead: not even deprioritised, out
    routes.withdraw(victim)
    with pytest.raises(NoRouteError) as info:
        asyncio.run(routes.route(4, NodeID("a"), 16))
    assert info.value.missing_layers == [4, 5, 6, 7]
    assert len(reads) == 2  # the failure was retried once on a fresh snapshot


def test_a_ban_only_deprioritises_the_only_holder_of_a_range() -> None:
    """Today's failure: the only holder of 4:8 failed once, was banned for 15 s and every request failed with
    "no route" meanwhile, although it served. Now the route goes through it, and through no other banned peer."""
    routes, _ = make_routes(
        [snapshot(peer_record("a", 0, 4), peer_record("a2", 0, 4), peer_record("b", 4, 8))], FakeClock()
    )
    routes.ban(NodeID("b"))
    routes.ban(NodeID("a2"))
    for _ in range(3):
        route = asyncio.run(routes.route(0, SOURCE, 16))
        assert [(s.peer_id, str(s.layers)) for s in route] == [("a", "0:4"), ("b", "4:8")]
    routes.ban(NodeID("a"))  # now every holder of 0:4 is banned too: still a route, not an error
    assert [s.peer_id for s in asyncio.run(routes.route(0, SOURCE, 16))][1] == "b"


def test_a_peer_seen_dead_is_routable_again_only_after_it_announces_again() -> None:
    clock = FakeClock()
    old = snapshot(peer_record("a", 0, 4, updated_at=100.0), peer_record("b", 4, 8, updated_at=100.0))
    same = snapshot(peer_record("a", 0, 4, updated_at=100.0), peer_record("b", 4, 8, updated_at=100.0))
    fresh = snapshot(peer_record("a", 0, 4, updated_at=100.0), peer_record("b", 4, 8, updated_at=112.0))
    routes, _ = make_routes([old, same, fresh], clock)
    assert len(asyncio.run(routes.route(0, SOURCE, 16))) == 2
    routes.withdraw(NodeID("b"))  # its record still says "serving" until it expires
    with pytest.raises(NoRouteError) as info:  # reads `same`: the stale record does not bring it back
        asyncio.run(routes.route(4, NodeID("a"), 16))
    assert info.value.missing_layers == [4, 5, 6, 7]
    assert routes.withdrawn == {NodeID("b"): 100.0}
    clock.now_s = 5.0  # the next read brings b's refreshed record: it was alive (or is back)
    assert [s.peer_id for s in asyncio.run(routes.route(4, NodeID("a"), 16))] == ["b"]
    assert routes.withdrawn == {}


def test_avoided_peers_are_left_out_without_a_ban_and_a_success_forgets_failures() -> None:
    clock = FakeClock()
    routes, _ = make_routes(
        [snapshot(peer_record("a", 0, 4), peer_record("b", 4, 8), peer_record("b2", 4, 8))], clock
    )
    for _ in range(3):  # plan-less routing may pick either replica; the avoided one never
        tail = asyncio.run(routes.route(4, NodeID("a"), 16, avoid=frozenset({NodeID("b")})))
        assert [s.peer_id for s in tail] == ["b2"]
    assert routes.bans.failures(NodeID("b")) == 0
    routes.ban(NodeID("b2"))
    clock.now_s = 11.0  # the ban is over; the failure is still remembered
    assert routes.bans.failures(NodeID("b2")) == 1
    routes.succeeded([NodeID("a"), NodeID("b2")])
    assert routes.bans.failures(NodeID("b2")) == 0


def test_routes_follow_the_plan_flows_and_a_new_epoch_replaces_the_router() -> None:
    peers = [peer_record("a", 0, 4), peer_record("b", 4, 8), peer_record("c", 4, 8)]
    flows = (
        EdgeFlow(SOURCE, NodeID("a"), 30.0),
        EdgeFlow(NodeID("a"), NodeID("b"), 20.0),
        EdgeFlow(NodeID("a"), NodeID("c"), 10.0),
    )
    placement = {NodeID("a"): LayerRange(0, 4), NodeID("b"): LayerRange(4, 8), NodeID("c"): LayerRange(4, 8)}
    plan1 = Plan("milp", placement, 30.0, flows, epoch=1)
    plan2 = Plan("milp", placement, 30.0, (*flows[:1], EdgeFlow(NodeID("a"), NodeID("c"), 30.0)), epoch=2)
    clock = FakeClock()
    routes, _ = make_routes([snapshot(*peers, plan=plan1), snapshot(*peers, plan=plan2)], clock)
    picks = [str(asyncio.run(routes.route(0, SOURCE, 16))[1].peer_id) for _ in range(6)]
    assert picks.count("b") == 4 and picks.count("c") == 2  # 20 : 10 tokens/s
    clock.now_s = 5.0  # the cached snapshot is stale: the next read brings epoch 2
    picks = [str(asyncio.run(routes.route(0, SOURCE, 16))[1].peer_id) for _ in range(3)]
    assert picks == ["c", "c", "c"]


def test_waiting_for_coverage_names_the_gap_at_the_deadline() -> None:
    routes, _ = make_routes([snapshot(peer_record("a", 0, 2), peer_record("b", 5, 8))], FakeClock())
    with pytest.raises(NoRouteError) as info:
        asyncio.run(routes.wait_for_coverage(0.0))
    assert info.value.missing_layers == [2, 3, 4]
    assert "2:5" in str(info.value)


# ------------------------------------------------------------------------------------------------ trust


def _even_plan() -> Plan:
    """a holds 0:4; b and c hold 4:8 and get equal flows."""
    placement = {NodeID("a"): LayerRange(0, 4), NodeID("b"): LayerRange(4, 8), NodeID("c"): LayerRange(4, 8)}
    flows = (
        EdgeFlow(SOURCE, NodeID("a"), 20.0),
        EdgeFlow(NodeID("a"), NodeID("b"), 10.0),
        EdgeFlow(NodeID("a"), NodeID("c"), 10.0),
    )
    return Plan("milp", placement, 20.0, flows, epoch=1)


def _share(routes: SwarmRoutes, peer: str, n: int = 100) -> float:
    picks = [asyncio.run(routes.route(0, SOURCE, 16))[1].peer_id for _ in range(n)]
    return picks.count(NodeID(peer)) / n


def test_a_peer_delivering_a_tenth_of_its_announced_speed_loses_its_flow() -> None:
    peers = [peer_record("a", 0, 4), peer_record("b", 4, 8), peer_record("c", 4, 8)]  # b1: 400 tokens/s/layer
    routes, _ = make_routes([snapshot(*peers, plan=_even_plan())], FakeClock())
    assert _share(routes, "b") == pytest.approx(0.5, abs=0.02)
    for _ in range(10):
        routes.observe(NodeID("b"), layers=4, tokens=1, compute_s=4 / 40.0)  # 40 tokens/s per layer: 10x less
        routes.observe(NodeID("c"), layers=4, tokens=1, compute_s=4 / 400.0)  # as announced
    assert routes.ratios[NodeID("b")] == pytest.approx(0.1, rel=0.05)
    assert routes.ratios[NodeID("c")] == pytest.approx(1.0)
    assert _share(routes, "b") <= 0.15  # from half the traffic to about a tenth of c's


def test_observed_speed_helpers() -> None:
    from swarm.routing.observed import discount_plan, flow_factor, observed_layer_tokens_s, speed_ratio

    assert observed_layer_tokens_s(4, 1, 0.01) == pytest.approx(400.0)
    assert observed_layer_tokens_s(4, 1, 0.0) is None
    assert speed_ratio(400.0, 4, 1, 0.1) == pytest.approx(0.1)
    assert speed_ratio(400.0, 4, 1, 0.001) == 1.0  # faster than announced counts as announced
    assert flow_factor(0.6) == 1.0 and flow_factor(0.1) == 0.1  # noise within 2x is forgiven
    plan = _even_plan()
    scaled = discount_plan(plan, {NodeID("b"): 0.1})
    assert [f.tokens_s for f in scaled.flows] == [20.0, 1.0, 10.0]
    assert discount_plan(plan, {}) is plan
    split = replace(plan, decode_flows=plan.flows)  # a plan with prefill and decode apart: both are scaled
    assert [f.tokens_s for f in discount_plan(split, {NodeID("b"): 0.1}).decode_flows] == [20.0, 1.0, 10.0]


def test_reported_peers_are_not_routed_and_announced_speed_is_capped() -> None:
    peers = {r.peer_id: r for r in (peer_record("a", 0, 8), peer_record("b", 0, 8))}
    reports = {"a": frozenset({"r1", "r2"})}
    snap = SwarmSnapshot(peers=peers, plan=None, planner_peer_id=None, fetched_at=0.0, reports=reports)
    assert set(routing_view(snap, 8, 0.9).peers) == {"b"}
    assert set(routing_view(snap, 8, 0.9, min_reporters=3).peers) == {"a", "b"}
    fast = snapshot(peer_record("a", 0, 8, decode_layer_tokens_s_b1=5e8))
    state = routing_view(fast, 8, 0.9, max_layer_tokens_s=1e6).peers[NodeID("a")]
    assert state.compute_s_per_layer == pytest.approx(1e-6)


def _slow_link_swarm() -> SwarmSnapshot:
    """p1, p2 hold 0:4, p3, p4 hold 4:8; every link 5 ms one way (10 ms RTT) but p1 <-> p3, 50 ms. The plan
    ignores latency: a quarter of the flow on each crossing."""
    fast, slow = LinkMeasure(rtt_s=0.01, bandwidth_bytes_s=1e8), LinkMeasure(rtt_s=0.1, bandwidth_bytes_s=1e7)
    records = [
        peer_record("p1", 0, 4, links={"p3": slow, "p4": fast}),
        peer_record("p2", 0, 4, links={"p3": fast, "p4": fast}),
        peer_record("p3", 4, 8, links={}),
        peer_record("p4", 4, 8, links={}),
    ]
    flows = [(SOURCE, "p1", 2.0), (SOURCE, "p2", 2.0), ("p3", SINK, 2.0), ("p4", SINK, 2.0)]
    flows += [(a, b, 1.0) for a in ("p1", "p2") for b in ("p3", "p4")]
    plan = Plan(
        method="test",
        placement={NodeID(r.peer_id): LayerRange(r.range_start, r.range_end) for r in records},
        max_flow_tokens_s=4.0,
        flows=tuple(EdgeFlow(NodeID(s), NodeID(d), f) for s, d, f in flows),
    )
    return snapshot(*records, plan=plan)


def test_announced_link_delays_reach_the_routing_view() -> None:
    view = routing_view(_slow_link_swarm(), 8, 0.9)
    assert view.links_s[(NodeID("p1"), NodeID("p3"))] == pytest.approx(0.05)
    assert view.links_s[(NodeID("p2"), NodeID("p4"))] == pytest.approx(0.005)
    view = routing_view(_slow_link_swarm(), 8, 0.9, client_rtt_s={NodeID("p2"): 0.04})
    assert view.peers[NodeID("p2")].latency_s == pytest.approx(0.02)  # one way: half the round trip
    assert view.peers[NodeID("p1")].latency_s == 0.0  # unmeasured


def test_a_lone_session_avoids_the_slow_link_and_open_sessions_spread_by_flow() -> None:
    routes, _ = make_routes([_slow_link_swarm()], FakeClock())

    def crosses_slow(route: tuple[Stage, ...]) -> bool:
        return [s.peer_id for s in route] == ["p1", "p3"]

    async def lone_sessions() -> list[bool]:
        out = []
        for i in range(40):
            out.append(crosses_slow(await routes.route(0, SOURCE, 16, session_id=f"s{i}")))
            routes.release(f"s{i}")
        return out

    assert not any(asyncio.run(lone_sessions()))
    assert routes.open_sessions == set()

    async def together() -> list[bool]:
        return [crosses_slow(await routes.route(0, SOURCE, 16, session_id=f"t{i}")) for i in range(40)]

    slow = asyncio.run(together())
    assert not slow[0] and 5 <= sum(slow) <= 10  # the plan's quarter, less the first session's turn
    assert len(routes.open_sessions) == 40


def test_client_round_trips_are_measured_once_per_end_peer_and_failures_stay_unmeasured() -> None:
    pinged: list[NodeID] = []

    async def ping(peer_id: NodeID) -> float:
        pinged.append(peer_id)
        if peer_id == "p2":
            raise ConnectionError("unreachable")
        if peer_id == "p3":
            await asyncio.sleep(10)  # past the ping timeout
        return 0.02

    clock = FakeClock()
    routes = SwarmRoutes(
        _reader(_slow_link_swarm()),
        8,
        cache_high_water=0.9,
        snapshot_max_age_s=2.0,
        bans=BanConfig(base_s=10.0, max_s=60.0),
        clock=clock,
        ping=ping,
        ping_timeout_s=0.05,
    )
    asyncio.run(routes.wait_for_coverage(1.0))
    # twice each that answers (the first may include dialling), once each that failed or timed out
    assert sorted(pinged) == ["p1", "p1", "p2", "p3", "p4", "p4"]
    assert routes.client_rtt_s == {"p1": 0.02, "p4": 0.02}
    asyncio.run(routes.route(0, SOURCE, 16, session_id="s"))  # no sooner than PING_RETRY_S: not again
    assert len(pinged) == 6
    clock.now_s = PING_RETRY_S
    asyncio.run(routes.route(0, SOURCE, 16, session_id="s"))  # then only the unmeasured
    assert sorted(pinged) == ["p1", "p1", "p2", "p2", "p3", "p3", "p4", "p4"]


def _reader(snap: SwarmSnapshot):  # type: ignore[no-untyped-def]
    async def read() -> SwarmSnapshot:
        return snap

    return read


def test_a_plan_with_decode_flows_gives_a_decode_route_by_them_and_one_without_gives_none() -> None:
    peers = [peer_record("a", 0, 4), peer_record("d", 0, 4), peer_record("e", 0, 4), peer_record("b", 4, 8)]
    placement = {NodeID(p.peer_id): LayerRange(p.range_start, p.range_end) for p in peers}
    prompt = (EdgeFlow(SOURCE, NodeID("a"), 30.0), EdgeFlow(NodeID("a"), NodeID("b"), 30.0))
    decode = (
        EdgeFlow(SOURCE, NodeID("d"), 20.0),
        EdgeFlow(SOURCE, NodeID("e"), 10.0),
        EdgeFlow(NodeID("d"), NodeID("b"), 20.0),
        EdgeFlow(NodeID("e"), NodeID("b"), 10.0),
    )
    split = Plan("milp", placement, 30.0, prompt, epoch=1, decode_flows=decode)
    routes, _ = make_routes([snapshot(*peers, plan=split)], FakeClock())
    assert [str(s.peer_id) for s in asyncio.run(routes.route(0, SOURCE, 16))] == ["a", "b"]
    firsts = [str(asyncio.run(routes.decode_route(16))[0].peer_id) for _ in range(6)]  # type: ignore[index]
    assert firsts.count("d") == 4 and firsts.count("e") == 2  # IWRR over the decode flows, 20 : 10
    # a decode peer routing must avoid leaves the other; with both avoided there is no decode route (no
    # fallback to any live peer: that would move sessions off the plan's decode flows)
    assert [str(s.peer_id) for s in asyncio.run(routes.decode_route(16, frozenset({NodeID("d")})))] == [
        "e",
        "b",
    ]
    assert asyncio.run(routes.decode_route(16, frozenset({NodeID("d"), NodeID("e")}))) is None
    single, _ = make_routes(
        [snapshot(*peers, plan=Plan("milp", placement, 30.0, prompt, epoch=1))], FakeClock()
    )
    assert asyncio.run(single.decode_route(16)) is None


def test_spot_check_holders_hold_their_weights_as_the_checked_peer_does() -> None:
    # an nf4 peer's honest answer differs from a float peer's: only peers with the same quant check each other
    snap = snapshot(
        peer_record("a", 0, 4, quant="nf4"),
        peer_record("a2", 0, 4, quant="nf4"),
        peer_record("af", 0, 4),
        peer_record("b", 4, 8),
    )
    routes, _ = make_routes([snap], FakeClock())  # a client of unquantized peers (ClientConfig.quant)
    layers = LayerRange(0, 4)
    assert asyncio.run(routes.holders(layers)) == ["af"]
    assert [s.peer_id for s in asyncio.run(routes.route(0, SOURCE, 16))] == ["af", "b"]
    routes.quant = "nf4"  # a client of nf4 peers: routes and checkers among them only
    assert sorted(asyncio.run(routes.holders(layers))) == ["a", "a2"]
    assert sorted(asyncio.run(routes.holders(layers, like=NodeID("a")))) == ["a", "a2"]
