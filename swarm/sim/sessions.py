"""Sessions in the simulation: admission, cache reservation along the route, release, and failover.

Requests get a route from swarm.routing's Router over the plan (the same masking the client uses: session
tokens = prompt + output against each peer's free KV cache below its high-water mark), reserve that cache
on every stage, and wait in FIFO order while no route exists. A session that loses a node fails over: with
SimConfig.partial_replay only the lost stage is replaced (swarm/sim/moves.py); without it the rest of the
route is rebuilt with Router.route_from and the prefix (prompt + generated tokens) replayed into all new
stages, as the client did before issue 13, or the session restarts from the prompt when no route is left.

With a plan that splits the phases (decode_flows), a session gets two routes at admission: it prefills on one
over the plan's flows (holding its prompt's KV there) and moves to one over the decode flows (holding the whole
session's KV there from the start) once the prompt is done: move_to_decode. The simulator does not combine such
plans with churn (re-plans are of one kind).
"""

from __future__ import annotations

from collections import deque

from swarm.errors import NoRouteError
from swarm.routing import Route
from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.links import Network
from swarm.sim.moves import Moves
from swarm.sim.records import SRC, Counters, Requests
from swarm.sim.view import SwarmView
from swarm.types import SOURCE


def _spans(starts: tuple[int, ...], num_layers: int) -> list[tuple[int, int]]:
    """The layers each stage of a route runs: from its start to the next stage's (the last: to the end)."""
    return list(zip(starts, (*starts[1:], num_layers), strict=True))


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
        self.last_admit_s = 0.0  # when the last waiting request got its route (the end of a saturated run)

    def arrive(self, r: int) -> None:
        self.waiting.append(r)
        self.try_admit()

    def try_admit(self) -> None:
        """Start waiting requests in FIFO order until one finds no route (then wait for cache to free up)."""
        view = self.view
        while self.waiting and not view.admission_blocked:
            r = self.waiting[0]
            tokens = self.requests.session_tokens(r)
            try:
                if view.decode_router is None:
                    route, decode = view.router.build(view.view, tokens), None
                else:  # split phases: the prefill route holds the prompt's KV only, until it moves
                    route = view.router.build(view.view, self.requests.prompt_kv_tokens(r))
                    decode = view.decode_router.build(view.view, tokens)
            except NoRouteError:
                view.admission_blocked = True
                return
            self.waiting.popleft()
            self.last_admit_s = self.events.now
            nodes, starts = [self.index[s.peer_id] for s in route], [s.layers.start for s in route]
            if decode is not None:
                self._reserve_split(r, nodes, [self.index[s.peer_id] for s in decode], decode)
            self._begin(r, nodes, starts, 0, reserve=decode is None)

    def _reserve_split(self, r: int, prefill: list[int], decode: list[int], route: Route) -> None:
        """Session r's KV room: the whole session on its decode route, the prompt on prefill-only stages."""
        requests = self.requests
        requests.decode_routes[r] = tuple(decode)
        requests.decode_starts[r] = tuple(s.layers.start for s in route)
        self.view.reserve(r, decode, requests.session_tokens(r))
        self.view.reserve(r, [i for i in prefill if i not in decode], requests.prompt_kv_tokens(r))

    def move_to_decode(self, r: int) -> bool:
        """Split phases: session r's prompt is done; each prefill stage sends the KV of the layers it ran to
        the decode stage(s) holding them, and r decodes there once all of it has arrived. False when r has no
        decode route to move to (it decodes on its prefill route)."""
        requests = self.requests
        nodes, starts = requests.decode_routes[r], requests.decode_starts[r]
        if not nodes:
            return False
        requests.decode_routes[r] = ()
        # The prompt's KV: the first generated token's is made by the first decode step, on the decode route.
        num_layers, tokens, now = self.moves.num_layers, requests.trace[r].prompt_tokens, self.events.now
        arrived_s, moved = now, 0
        for i, (a, b) in zip(requests.routes[r], _spans(requests.stage_starts[r], num_layers), strict=True):
            for j, (c, d) in zip(nodes, _spans(starts, num_layers), strict=True):
                overlap = min(b, d) - max(a, c)
                if overlap > 0 and i != j:
                    nbytes = self.moves.kv_bytes(overlap, tokens)
                    moved += nbytes
                    arrived_s = max(arrived_s, self.network.transfer(i, j, nbytes))
        self.counters.phase_moves += 1
        self.counters.phase_move_bytes += moved
        self.counters.phase_move_s += arrived_s - now
        epoch = requests.epoch[r]
        self.events.at(arrived_s, lambda: self._resume_decode(r, epoch, nodes, starts))
        return True

    def _resume_decode(self, r: int, epoch: int, nodes: tuple[int, ...], starts: tuple[int, ...]) -> None:
        """r's KV is on every decode stage: free the prefill-only stages, send the pending step into the route."""
        requests = self.requests
        if requests.epoch[r] != epoch or requests.done_s[r] >= 0:
            return  # the session failed over (or ended) while its KV moved
        prefill_only = [i for i in requests.routes[r] if i not in nodes]
        self.view.release_moved(r, prefill_only, requests.prompt_kv_tokens(r))
        requests.routes[r], requests.stage_starts[r], requests.stage[r] = nodes, starts, 0
        quantum = self.config.decode_quantum_tokens
        self.network.send(SRC, nodes[0], self.token_bytes * quantum, [requests.key(r)], False)
        self.try_admit()

    def _begin(
        self, r: int, nodes: list[int], starts: list[int], from_stage: int, reserve: bool = True
    ) -> None:
        """Reserve cache on stages from_stage.. (unless the caller did) and send the prompt (plus any replayed
        tokens) into them."""
        requests = self.requests
        if reserve:
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
        """Free r's cache on stages from_stage.. of its route (and on a decode route it has not moved to)."""
        requests, tokens = self.requests, self.requests.session_tokens(r)
        decode = requests.decode_routes[r]
        if from_stage == 0 and decode:
            # Split phases, before the move: the prompt's KV on prefill-only stages, the session's on the rest.
            prefill_only = tuple(i for i in requests.routes[r] if i not in decode)
            self.view.release(r, prefill_only, requests.prompt_kv_tokens(r))
            self.view.release(r, decode, tokens)
            requests.decode_routes[r] = ()
        else:
            self.view.release(r, requests.routes[r][from_stage:], tokens)

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
