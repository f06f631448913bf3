"""What the router sees of the simulated swarm: each node's layers and free KV cache, and the plan's router.

Sessions reserve cache on every stage of their route and release it when they end or move; each change is
announced to the router's view at once, as a live peer's record would be (the client masks peers fuller than
SimConfig.cache_high_water). `admission_blocked` is set when a waiting request found no route, and cleared
whenever cache frees up or the swarm changes, so admission is retried only when it may succeed.
"""

from __future__ import annotations

from collections.abc import Callable

from swarm.routing import PeerState, Router, RoutingView
from swarm.sim.config import SimConfig
from swarm.sim.records import Node
from swarm.types import NodeID, Plan

RouterFactory = Callable[[Plan], Router]


class SwarmView:
    def __init__(self, nodes: list[Node], num_layers: int, config: SimConfig, router: Router) -> None:
        self.nodes = nodes
        self.config = config
        self.router = router
        self.decode_router: Router | None = None  # split phases: routes decode over the plan's decode_flows
        self.peers: dict[NodeID, PeerState] = {}  # what the router reads
        self.view = RoutingView(num_layers, self.peers)
        self.admission_blocked = False

    def announce(self, node: Node) -> None:
        """Publish node's layers and free cache (below the high-water mark) to the router."""
        assert node.layers is not None
        reserve = int((1.0 - self.config.cache_high_water) * node.cache_total)
        self.peers[node.id] = PeerState(
            node.id, node.layers, node.cache_total - node.cache_used, 0.0, 0.0, reserve
        )

    def withdraw(self, node: Node) -> None:
        self.peers.pop(node.id, None)

    def changed(self, router: Router | None = None, decode_router: Router | None = None) -> None:
        """The swarm or the plan changed (a node came up or moved, a new plan's routers): admission may succeed.
        A new plan's router comes with its decode router (None: the plan does not split the phases)."""
        if router is not None:
            self.router, self.decode_router = router, decode_router
        self.admission_blocked = False

    def reserve(self, r: int, stages: list[int], tokens: int) -> None:
        """Session r takes `tokens` of cache on each of `stages` (node indices)."""
        for i in stages:
            node = self.nodes[i]
            node.cache_used += tokens
            node.sessions.add(r)
            self.announce(node)

    def reserve_missing(self, r: int, stages: list[int], tokens: int) -> None:
        """Like reserve, on those of `stages` that do not hold session r yet."""
        for i in stages:
            node = self.nodes[i]
            if r not in node.sessions:
                node.sessions.add(r)
                node.cache_used += tokens
                self.announce(node)

    def release(self, r: int, stages: tuple[int, ...], tokens: int) -> None:
        """Session r ended or left `stages`: free its cache there. A node that drains an old range after a
        move (make before break) drops that range with its last old session."""
        for i in stages:
            node = self.nodes[i]
            if r in node.sessions:
                node.sessions.discard(r)
                node.cache_used -= tokens
                if node.draining:
                    node.draining.discard(r)
                    if not node.draining:
                        node.old_layers = None
                if node.alive:
                    self.announce(node)
        self.admission_blocked = False

    def release_moved(self, r: int, stages: list[int], tokens: int) -> None:
        """Session r moved off `stages` (a replaced stage, a hand-over): free its cache there. Unlike release,
        a draining node's old range stays even when this was its last old session."""
        for i in stages:
            node = self.nodes[i]
            if r in node.sessions:
                node.sessions.discard(r)
                node.draining.discard(r)
                node.cache_used -= tokens
                if node.alive:
                    self.announce(node)
        self.admission_blocked = False
