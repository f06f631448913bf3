"""The discrete-event serving simulation (one heapq of timed events): the Simulation object and its event loop.

What is modelled, and where:
* Requests arrive (trace), are admitted onto a route from swarm.routing's Router, reserve KV cache on every
  stage, and wait in FIFO order while no route exists (swarm/sim/sessions.py).
* A prefill travels the route stage by stage; the LM head runs on the client; then every decode step sends
  one token through all stages again, until the request's output length is reached.
* Each node runs iterations back to back while it has work (continuous batching, swarm/sim/batching.py):
  every decode token waiting when an iteration starts joins it, plus prefill jobs up to a token budget.
  Iteration time comes from the node's timing model (swarm/sim/timing.py).
* Each directed link is a FIFO pipe (swarm/sim/links.py): a message waits for the previous one to finish
  sending, takes bytes / bandwidth to send, then arrives `latency_s` later. A node's outputs for the same
  next hop travel as one message.
* Nodes may share a host's cores with other nodes and the client (swarm/sim/hosts.py): their iterations
  then slow down by processor sharing while more processes than cores are busy. The client on a host is one
  process that handles arriving outputs one message at a time (LM head + sampling, client_step_s per token);
  without a host, client_step_s is a plain delay (many independent clients). See swarm/sim/client_side.py.
* A plan that splits the phases (Plan.decode_flows) gives each session a prefill route and a decode route; after
  the prompt its KV moves from one to the other over the links, then it decodes (swarm/sim/sessions.py).
* Churn (swarm/sim/churn.py) removes, adds and moves nodes; sessions on a lost node fail over. With
  SimConfig.partial_replay (swarm/sim/moves.py) only the lost stage is re-routed and replayed, and a session
  with no route waits; without it the rest of the route is rebuilt with Router.route_from and the prefix
  (prompt + generated tokens) replayed into all new stages, as the client did before issue 13
  (swarm/sim/sessions.py). KV hand-over and make before break are in swarm/sim/moves.py and churn.py.
  Replays are prefilled in chunks of replay_chunk_tokens per iteration next to the decode batch (0: whole,
  like any prefill).

Per event the work is O(log n) for the heap plus O(1) per token carried. Hot loops use plain lists and ints.
Tokens in flight are tagged with the request's failover epoch (key = request << 8 | epoch), so tokens of a
session that failed over are dropped wherever they are, in O(1).

Each part is an object that owns its state, wired here by what is passed to its constructor: EventQueue
(events.py: the clock and the heap), Network (links.py), SwarmView (view.py: what the router sees, cache
reservations), Batcher (batching.py), Moves (moves.py), Sessions (sessions.py), Client (client_side.py). The
records they share (Node, Link, Requests, Counters) are in records.py. Simulation dispatches events to them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from swarm.planner.cluster import Cluster
from swarm.routing import Router
from swarm.sim.batching import Batcher
from swarm.sim.client_side import Client
from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.hosts import CLIENT, hosts_of
from swarm.sim.links import Network
from swarm.sim.moves import Moves
from swarm.sim.records import (
    ARRIVE,
    CLIENT_DECODE,
    CLIENT_PREFILL,
    DELIVER_DECODE,
    DELIVER_PREFILL,
    HOST_DONE,
    NODE_DONE,
    SNK,
    SRC,
    TIMER,
    Counters,
    Link,
    Node,
    Requests,
)
from swarm.sim.sessions import Sessions
from swarm.sim.timing import NodeTiming
from swarm.sim.trace import Request
from swarm.sim.view import RouterFactory, SwarmView
from swarm.types import LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)

# Re-exported: report, churn and the tests import these from here.
__all__ = ["SNK", "SRC", "Link", "Node", "RouterFactory", "SimConfig", "Simulation"]


class Simulation:
    """One run: a cluster, a plan, a way to route, a trace. `run()` returns itself with the results filled in:
    per-request times in `requests`, churn's cost in `counters`, tokens over time in `client.buckets`."""

    def __init__(
        self,
        cluster: Cluster,
        plan: Plan,
        make_router: RouterFactory,
        trace: list[Request],
        config: SimConfig | None = None,
    ) -> None:
        self.cluster = cluster
        self.config = config = config or SimConfig()
        if config.decode_quantum_tokens < 1:
            raise ValueError(f"decode_quantum_tokens must be >= 1, got {config.decode_quantum_tokens}")
        self.make_router = make_router
        self.plan = plan
        router, decode_router = self.routers(plan)
        self.trace = trace
        self.ids: list[NodeID] = [n.id for n in cluster.nodes]
        self.index = {n: i for i, n in enumerate(self.ids)}
        self.nodes = [Node(n) for n in self.ids]
        self.hosts, node_hosts = hosts_of(cluster, config.client_host)
        for node, host in zip(self.nodes, node_hosts, strict=True):
            node.host = host
        client_host = None if config.client_host is None else self.hosts[config.client_host]
        act_bytes, token_bytes = cluster.model.activation_bytes_per_token, cluster.model.token_id_bytes
        num_layers = cluster.model.num_layers

        self.events = EventQueue()
        self.requests = Requests(trace)
        self.counters = Counters()
        self.view = SwarmView(self.nodes, num_layers, config, router)
        self.view.decode_router = decode_router
        self.network = Network(cluster, self.nodes, config, self.events)
        self.batcher = Batcher(
            self.nodes, self.requests, self.network, self.events, config, act_bytes, token_bytes
        )
        self.moves = Moves(
            self.nodes,
            self.requests,
            self.view,
            self.network,
            self.events,
            config,
            self.counters,
            num_layers,
            act_bytes,
            token_bytes,
        )
        self.sessions = Sessions(
            self.requests,
            self.view,
            self.moves,
            self.network,
            self.events,
            config,
            self.counters,
            act_bytes,
            token_bytes,
        )
        self.client = Client(
            self.requests,
            self.sessions,
            self.network,
            self.events,
            config,
            client_host,
            act_bytes,
            token_bytes,
        )
        for node_id, layers in plan.placement.items():
            self.set_layers(self.index[node_id], layers)

    @property
    def now(self) -> float:
        return self.events.now

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action` at simulated time t (churn events, reloads)."""
        self.events.at(t, action)

    def run(self) -> Simulation:
        events, batcher, client, sessions, nodes = (
            self.events,
            self.batcher,
            self.client,
            self.sessions,
            self.nodes,
        )
        for req in self.trace:
            events.push(req.arrival_s, ARRIVE, req.index)
        for kind, a, b in events.drain():
            if kind == NODE_DONE:
                batcher.finish(a, b)  # type: ignore[arg-type]
            elif kind == DELIVER_DECODE:
                batcher.deliver_decode(a, b)  # type: ignore[arg-type]
            elif kind == CLIENT_DECODE:
                client.arrive(CLIENT_DECODE, b)  # type: ignore[arg-type]
            elif kind == DELIVER_PREFILL:
                batcher.deliver_prefill(a, b)  # type: ignore[arg-type]
            elif kind == CLIENT_PREFILL:
                client.arrive(CLIENT_PREFILL, b)  # type: ignore[arg-type]
            elif kind == ARRIVE:
                sessions.arrive(a)
            elif kind == TIMER:
                events.fire(a)
            elif kind == HOST_DONE:
                for proc in b.finish(events.now, a, events.schedule_host):  # type: ignore[attr-defined]
                    if proc == CLIENT:
                        client.done()
                    else:
                        batcher.finish(proc, nodes[proc].incarnation)
        return self

    # -- nodes -----------------------------------------------------------------------------------------

    def set_layers(self, i: int, layers: LayerRange) -> None:
        """Node i comes up holding `layers` (joined, or reloaded for a new plan)."""
        node = self.nodes[i]
        node.alive, node.incarnation = True, node.incarnation + 1
        node.cache_used, node.busy = 0, False
        node.decode_q, node.prefill_q, node.sessions = [], deque(), set()
        node.replay_q, node.cur_replay, node.cur_replay_tokens = deque(), [], 0
        self.relayer(i, layers)

    def relayer(self, i: int, layers: LayerRange) -> None:
        """Node i now serves `layers` to new sessions; its sessions and work in flight stay."""
        node, spec, config = self.nodes[i], self.cluster.node_by_id[self.ids[i]], self.config
        cap, quantum = config.max_batch_tokens, config.decode_quantum_tokens
        node.layers = layers
        node.timing = timing = NodeTiming(
            node.id, spec.tokens_s(len(layers)), len(layers), spec.extra, config.timing, cap
        )
        node.decode_iter_s = [timing.decode_s(b) * quantum for b in range(cap + 1)]
        kv_table = spec.extra.get("kv_tokens_by_layers")  # KV room by layers held (swarm.planner.split)
        if kv_table is not None and len(kv_table) >= len(layers):
            node.cache_total = int(kv_table[len(layers) - 1])
        else:
            node.cache_total = int(spec.extra.get("cache_tokens", config.cache_layer_tokens // len(layers)))
        self.view.announce(node)
        self.view.changed()
        self.moves.retry_stalled()

    def remove(self, i: int) -> list[int]:
        """Node i leaves (or starts reloading). Returns the sessions that were using it."""
        node = self.nodes[i]
        if node.host is not None:
            node.host.cancel(self.events.now, i, self.events.schedule_host)
        node.alive, node.incarnation, node.busy = False, node.incarnation + 1, False
        node.decode_q, node.prefill_q, node.cur_decode, node.cur_prefill = [], deque(), [], []
        node.replay_q, node.cur_replay, node.cur_replay_tokens = deque(), [], 0
        node.old_layers, node.draining = None, set()
        self.view.withdraw(node)
        lost, node.sessions = sorted(node.sessions), set()
        return lost

    # -- sessions and the plan -------------------------------------------------------------------------

    def try_admit(self) -> None:
        """Start waiting requests in FIFO order until one finds no route (swarm/sim/sessions.py)."""
        self.sessions.try_admit()

    def fail_over(self, r: int, lost: int) -> None:
        """Node `lost` no longer serves session r: re-route and replay (swarm/sim/sessions.py)."""
        self.sessions.fail_over(r, lost)

    def give_up(self, i: int, sessions: list[int]) -> None:
        """Node i gives up `sessions`: hand them over (KV hand-over) or fail them over."""
        self.sessions.give_up(i, sessions)

    def set_plan(self, plan: Plan) -> None:
        self.plan = plan
        self.view.changed(*self.routers(plan))
        self.moves.retry_stalled()

    def routers(self, plan: Plan) -> tuple[Router, Router | None]:
        """The plan's router, and its decode router when the plan splits the phases (swarm.types.Plan): then
        sessions prefill on a route over `flows` and move to one over `decode_flows` (swarm/sim/sessions.py)."""
        if not plan.decode_flows:
            return self.make_router(plan), None
        prefill = self.make_router(replace(plan, decode_flows=()))
        # A prompt waits for room on the plan's prefill route rather than fall back onto the decode peers: a
        # prompt there would stall their decode batches, which is what splitting the phases avoids.
        prefill.config = replace(prefill.config, fallback_to_latency=False)
        return prefill, self.make_router(replace(plan, flows=plan.decode_flows, decode_flows=()))
