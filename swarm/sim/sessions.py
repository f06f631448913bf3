"""Sessions in the simulation: admission, cache reservation along the route, release, and failover.

Requests get a route from swarm.routing's Router over the plan (the same masking the client uses: session
tokens = prompt + output against each peer's free KV cache below its high-water mark), reserve that cache
on every stage, and wait in FIFO order while no route exists. A session that loses a node fails over: with
SimConfig.partial_replay only the lost stage is replaced (swarm/sim/moves.py); without it the rest of the
route is rebuilt with Router.route_from and the prefix (prompt + generated tokens) replayed into all new
stages, as the client did before issue 13, or the session restarts from the prompt when no route is left.
"""

from __future__ import annotations

from collections import deque

from swarm.errors import NoRouteError
from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.links import Network
from swarm.sim.moves import Moves
from swarm.sim.records import SRC, Counters, Requests
from swarm.sim.view import SwarmView
from swarm.types import SOURCE


class Sessions:
    """Admits waiting requests, ends finished ones, and moves the sessions of a node that leaves."""

    def __init__(
        self,
        requests: Requests,
        view: SwarmView,
        moves: Moves,
        network: Network,
        events: EventQueue,
        config: SimConfig,
        counters: Counters,
        act_bytes: int,
        token_bytes: int,
    ) -> None:
        self.requests = requests
        self.view = view
        self.moves = moves
        self.network = network
        self.events = events
        self.config = config
        self.counters = counters
        self.act_bytes = act_bytes
        self.token_bytes = token_bytes
        self.index = moves.index
        self.waiting: deque[int] = deque()

    def arrive(self, r: int) -> None:
        self.waiting.append(r)
        self.try_admit()

    def try_admit(self) -> None:
        """Start waiting requests in FIFO order until one finds no route (then wait for cache to free up)."""
        view = self.view
        while self.waiting and not view.admission_blocked:
            r = self.waiting[0]
            try:
                route = view.router.build(view.view, self.requests.session_tokens(r))
            except NoRouteError:
                view.admission_blocked = True
                return
            self.waiting.popleft()
            self._begin(r, [self.index[s.peer_id] for s in route], [s.layers.start for s in route], 0)

    def _begin(self, r: int, nodes: list[int], starts: list[int], from_stage: int) -> None:
        """Reserve cache on stages from_stage.. and send the prompt (plus any replayed tokens) into them."""
        requests = self.requests
        self.view.reserve(r, nodes[from_stage:], requests.session_tokens(r))
        requests.routes[r], requests.stage_starts[r] = tuple(nodes), tuple(starts)
        requests.stage[r] = from_stage
        requests.replay_end[r] = len(nodes)
        requests.replaying[r] = requests.generated[r] > 0
        if requests.generated[r] > 0:
            self.counters.replayed_tokens += requests.length(r) * (len(nodes) - from_stage)
        requests.epoch[r] += 1
        tokens = requests.length(r)
        per_token = self.token_bytes if from_stage == 0 else self.act_bytes  # mid-route replays hidden states
        self.network.send(SRC, nodes[from_stage], tokens * per_token, [(requests.key(r), tokens)], True)

    def _release(self, r: int, from_stage: int = 0) -> None:
        """Free r's cache on stages from_stage.. of its route."""
        self.view.release(r, self.requests.routes[r][from_stage:], self.requests.session_tokens(r))

    def finish(self, r: int) -> None:
        """Request r generated its last token: free its route and let waiting requests in."""
        self.requests.done_s[r] = self.events.now
        self._release(r)
        self.try_admit()

    def give_up(self, i: int, sessions: list[int]) -> None:
        """Node i gives up `sessions` (it leaves or moves): hand each over where the feature is on and a
        successor exists, else fail over."""
        for r in sessions:
            if not (self.config.kv_handover and self.moves.hand_over(i, r)):
                self.fail_over(r, i)

    def fail_over(self, r: int, lost: int) -> None:
        """Node `lost` no longer serves session r: re-route and replay (swarm/sim/moves.py when partial)."""
        requests = self.requests
        if requests.done_s[r] >= 0:
            return
        if self.config.partial_replay:
            self.moves.fail_over_partial(r, lost)
            return
        self.counters.failovers += 1
        nodes = list(requests.routes[r])
        k = nodes.index(lost)
        requests.epoch[r] += 1  # tokens of r in flight anywhere are now stale
        if requests.generated[r] > 0:
            start = requests.stage_starts[r][k]
            prev = self.view.nodes[nodes[k - 1]].id if k > 0 else SOURCE
            self._release(r, k)
            try:
                tail = self.view.router.route_from(self.view.view, start, prev, requests.session_tokens(r))
            except NoRouteError:
                pass
            else:
                self._begin(
                    r,
                    nodes[:k] + [self.index[s.peer_id] for s in tail],
                    list(requests.stage_starts[r][:k]) + [s.layers.start for s in tail],
                    k,
                )
                return
        # Still prefilling, or no way round the lost node: start over from the prompt when a route frees up.
        self._release(r)
        self.counters.restarts += 1
        self.waiting.appendleft(r)
        self.try_admit()
