"""The simulator's sampling router: draws follow the plan's weights and skip masked peers."""

from __future__ import annotations

import random

import pytest

from swarm.errors import NoRouteError
from swarm.routing import PeerState, RoutingView
from swarm.sim.scheduling import SampledRouter
from swarm.types import SINK, SOURCE, EdgeFlow, LayerRange, NodeID, Plan

pytestmark = pytest.mark.timeout(30)

N = NodeID

# a, b hold 0:4 and 0:2; c, d hold 2:6 and 3:6: the source sends 3 to a and 1 to b.
PLACEMENT = {
    N("a"): LayerRange(0, 4),
    N("b"): LayerRange(0, 2),
    N("c"): LayerRange(2, 6),
    N("d"): LayerRange(3, 6),
}
FLOWS = [(SOURCE, "a", 3.0), (SOURCE, "b", 1.0), ("a", "c", 1.0), ("a", "d", 2.0), ("b", "c", 1.0)]
FLOWS += [("c", SINK, 2.0), ("d", SINK, 2.0)]
PLAN = Plan("test", PLACEMENT, 4.0, tuple(EdgeFlow(N(s), N(d), f) for s, d, f in FLOWS))


def view(**overrides: PeerState) -> RoutingView:
    peers = {n: PeerState(n, r, 10_000, latency_s=0.01) for n, r in PLACEMENT.items()}
    peers.update({N(k): v for k, v in overrides.items()})
    return RoutingView(6, peers)


def test_weighted_random_picks_follow_weights_and_masks() -> None:
    router = SampledRouter(PLAN, random.Random(7))
    live = view(d=PeerState(N("d"), LayerRange(3, 6), free_cache_tokens=0))
    routes = [router.build(live, session_tokens=1) for _ in range(4000)]
    assert all(s.peer_id != "d" for r in routes for s in r)
    share_a = sum(r[0].peer_id == "a" for r in routes) / 4000
    assert abs(share_a - 0.75) < 0.03


def test_every_candidate_masked_is_a_no_route_error() -> None:
    router = SampledRouter(PLAN, random.Random(0))
    full_a = PeerState(N("a"), LayerRange(0, 4), free_cache_tokens=0)
    full_b = PeerState(N("b"), LayerRange(0, 2), free_cache_tokens=0)
    with pytest.raises(NoRouteError) as info:
        router.build(view(a=full_a, b=full_b), session_tokens=1)
    assert info.value.missing_layers == [0, 1]
