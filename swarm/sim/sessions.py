"""Sessions in the simulation: admission, cache reservation along the route, release, and failover.

Requests get a route from swarm.routing's Router over the plan (the same masking the client uses: session
tokens = prompt + output against each peer's free KV cache below its high-water mark), reserve that cache
on every stage, and wait in FIFO order while no route exists. A session that loses a node fails over: with
SimConfig.partial_replay only the lost stage is replaced (swarm/sim/moves.py); without it the rest of the
route is rebuilt with Router.route_from and the prefix (prompt + generated tokens) replayed into all new
stages, as the client did before issue 13, or the session restarts from the prompt when no route is left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.errors import NoRouteError
from swarm.sim import moves
from swarm.sim.links import send
from swarm.sim.records import SRC
from swarm.types import SOURCE

if TYPE_CHECKING:
    from swarm.sim.engine import Simulation


def try_admit(sim: Simulation) -> None:
    """Start waiting requests in FIFO order until one finds no route (then wait for cache to free up)."""
    while sim.waiting and not sim.admission_blocked:
        r = sim.waiting[0]
        try:
            route = sim.router.build(sim.view, sim.session_tokens(r))
        except NoRouteError:
            sim.admission_blocked = True
            return
        sim.waiting.popleft()
        begin(sim, r, [sim.index[s.peer_id] for s in route], [s.layers.start for s in route], 0)


def begin(sim: Simulation, r: int, nodes: list[int], starts: list[int], from_stage: int) -> None:
    """Reserve cache on stages from_stage.. and send the prompt (plus any replayed tokens) into them."""
    need = sim.session_tokens(r)
    for i in nodes[from_stage:]:
        node = sim.nodes[i]
        node.cache_used += need
        node.sessions.add(r)
        sim._announce(node)
    sim.routes[r], sim.stage_starts[r] = tuple(nodes), tuple(starts)
    sim.stage[r] = from_stage
    sim.replay_end[r] = len(nodes)
    sim.replaying[r] = sim.generated[r] > 0
    if sim.generated[r] > 0:
        sim.replayed_tokens += (sim.trace[r].prompt_tokens + sim.generated[r]) * (len(nodes) - from_stage)
    sim.epoch[r] += 1
    key = r << 8 | (sim.epoch[r] & 255)
    tokens = sim.trace[r].prompt_tokens + sim.generated[r]
    per_token = sim.token_bytes if from_stage == 0 else sim.act_bytes  # mid-route replays hidden states
    send(sim, SRC, nodes[from_stage], tokens * per_token, [(key, tokens)], True)


def release(sim: Simulation, r: int, from_stage: int = 0) -> None:
    """Free r's cache on stages from_stage.. of its route (a draining node drops its old range at the last)."""
    need = sim.session_tokens(r)
    for i in sim.routes[r][from_stage:]:
        node = sim.nodes[i]
        if r in node.sessions:
            node.sessions.discard(r)
            node.cache_used -= need
            if node.draining:
                node.draining.discard(r)
                if not node.draining:
                    node.old_layers = None  # make before break: the old range is dropped now
            if node.alive:
                sim._announce(node)
    sim.admission_blocked = False


def finish(sim: Simulation, r: int) -> None:
    """Request r generated its last token: free its route and let waiting requests in."""
    sim.done_s[r] = sim.now
    release(sim, r)
    try_admit(sim)


def fail_over(sim: Simulation, r: int, lost: int) -> None:
    """Node `lost` no longer serves session r: re-route and replay (swarm/sim/moves.py when partial)."""
    if sim.done_s[r] >= 0:
        return
    if sim.config.partial_replay:
        moves.fail_over_partial(sim, r, lost)
        return
    sim.failovers += 1
    nodes = list(sim.routes[r])
    k = nodes.index(lost)
    sim.epoch[r] += 1  # tokens of r in flight anywhere are now stale
    if sim.generated[r] > 0:
        start = sim.stage_starts[r][k]
        prev = sim.ids[nodes[k - 1]] if k > 0 else SOURCE
        release(sim, r, k)
        try:
            tail = sim.router.route_from(sim.view, start, prev, sim.session_tokens(r))
        except NoRouteError:
            pass
        else:
            begin(
                sim,
                r,
                nodes[:k] + [sim.index[s.peer_id] for s in tail],
                list(sim.stage_starts[r][:k]) + [s.layers.start for s in tail],
                k,
            )
            return
    # Still prefilling, or no way round the lost node: start over from the prompt when a route frees up.
    release(sim, r)
    sim.restarts += 1
    sim.waiting.appendleft(r)
    try_admit(sim)
