"""Pure route building: plan + live snapshot -> Route (IWRR over edge flows, overlaps, masking, bans)."""

from swarm.routing.bans import BanConfig, BanList
from swarm.routing.iwrr import IWRR
from swarm.routing.route import (
    PeerState,
    Route,
    Router,
    RoutingConfig,
    RoutingView,
    Stage,
    check_route,
    crosses,
    link_session_share,
    route_text,
)

__all__ = [
    "IWRR",
    "BanConfig",
    "BanList",
    "PeerState",
    "Route",
    "Router",
    "RoutingConfig",
    "RoutingView",
    "Stage",
    "check_route",
    "crosses",
    "link_session_share",
    "route_text",
]
