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
* Churn (swarm/sim/churn.py) removes, adds and moves nodes; sessions on a lost node fail over. With
  SimConfig.partial_replay (swarm/sim/moves.py) only the lost stage is re-routed and replayed, and a session
  with no route waits; without it the rest of the route is rebuilt with Router.route_from and the prefix
  (prompt + generated tokens) replayed into all new stages, as the client did before issue 13
  (swarm/sim/sessions.py). KV hand-over and make before break are in swarm/sim/moves.py and churn.py.
  Replays are prefilled in chunks of replay_chunk_tokens per iteration next to the decode batch (0: whole,
  like any prefill).

Per event the work is O(log n) for the heap plus O(1) per token carried. Hot loops use plain lists and ints.
Tokens in flight are tagged with the request's failover epoch (key = request << 8 | epoch), so tokens of a
session that failed over are dropped wherever they are, in O(1). The state lives on Simulation and in the
records of swarm/sim/records.py; the modules above are functions of it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heappop, heappush

from swarm.planner.cluster import Cluster
from swarm.routing import PeerState, Router, RoutingView
from swarm.sim import links, moves, sessions
from swarm.sim.batching import finish_iteration, queue_prefill, start_iteration, take_replays
from swarm.sim.client_side import client_arrive, client_done
from swarm.sim.hosts import CLIENT, Host, hosts_of
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
    Link,
    Node,
)
from swarm.sim.timing import NodeTiming, TimingDefaults
from swarm.sim.trace import Request
from swarm.types import LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)

# Re-exported: report, churn and the tests import these from here.
__all__ = [
    "ARRIVE", "CLIENT_DECODE", "CLIENT_PREFILL", "DELIVER_DECODE", "DELIVER_PREFILL", "HOST_DONE", "NODE_DONE",
    "SNK", "SRC", "TIMER", "Link", "Node", "RouterFactory", "SimConfig", "Simulation",
]  # fmt: skip


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulation that are not in CLUSTER.json."""

    prefill_budget_tokens: int = 4096  # prompt tokens one iteration may take in (chunked prefill)
    # Decode tokens per iteration: a micro-batch, so several are in flight in a pipeline. Also the full batch
    # at which derived timing (no tables) runs a node at its tokens_s, the planner's figure.
    max_batch_tokens: int = 32
    cache_layer_tokens: int = 20_000_000  # KV cache of a node without "cache_tokens": tokens x layers it fits
    cache_high_water: float = 0.9  # like the client: a peer fuller than this takes no new session
    client_step_s: float = 0.0  # LM head + sampling on the client per decode step
    client_host: str | None = None  # the client runs on this host (swarm/sim/hosts.py), sharing its cores
    missing_link_latency_s: float = 0.1  # a hop with no link in CLUSTER.json (fallback routes only)
    missing_link_bandwidth_bytes_s: float = 12.5e6
    bucket_s: float = 10.0  # width of the throughput-over-time buckets
    # Decode tokens a session advances per pass through its route. 1 is exact; K > 1 simulates K consecutive
    # steps as one (K x compute, K x link latency and bytes, batch membership fixed for the K steps), which
    # cuts events K-fold for large runs at the price of coarser interleaving.
    decode_quantum_tokens: int = 1
    timing: TimingDefaults = field(default_factory=TimingDefaults)
    # Churn behaviour (swarm/sim/moves.py); False / 0 everywhere is the swarm before issue 13.
    make_before_break: bool = True  # a moved node serves its old sessions while it loads, and drains them
    partial_replay: bool = True  # a failover replays only through the replaced stage(s), from their inputs
    kv_handover: bool = True  # a leaving or moving node streams its sessions' KV caches to a successor
    replay_chunk_tokens: int = 256  # replay tokens one iteration may take in (0: a replay is one prefill)
    # KV bytes per token per layer = 2 (K and V) * kv_heads * head_dim * dtype bytes = 2 * activation bytes
    # * kv_heads / heads: LLaMA-2-70B has 8 KV heads of 64 (the synthetic clusters' 70B class).
    kv_heads_fraction: float = 0.125


RouterFactory = Callable[[Plan], Router]


class Simulation:
    """One run: a cluster, a plan, a way to route, a trace. `run()` returns itself with the results filled in."""

    def __init__(
        self,
        cluster: Cluster,
        plan: Plan,
        make_router: RouterFactory,
        trace: list[Request],
        config: SimConfig | None = None,
    ) -> None:
        self.cluster = cluster
        self.config = config or SimConfig()
        self.make_router = make_router
        self.plan = plan
        self.router = make_router(plan)
        self.trace = trace
        self.ids: list[NodeID] = [n.id for n in cluster.nodes]
        self.index = {n: i for i, n in enumerate(self.ids)}
        self.nodes = [Node(n) for n in self.ids]
        self.hosts, node_hosts = hosts_of(cluster, self.config.client_host)
        for node, host in zip(self.nodes, node_hosts, strict=True):
            node.host = host
        self.client_host = None if self.config.client_host is None else self.hosts[self.config.client_host]
        self.client_q: deque[tuple[int, list]] = deque()  # type: ignore[type-arg]
        self.client_busy = False
        self.peers: dict[NodeID, PeerState] = {}
        self.view = RoutingView(cluster.model.num_layers, self.peers)
        # Keyed by one int, (src + 2) * stride + dst + 2, not a (src, dst) tuple: the hot path looks up a link
        # per message.
        self.links: dict[int, Link] = {}
        self._link_stride = len(self.ids) + 2
        self.act_bytes = cluster.model.activation_bytes_per_token
        if self.config.decode_quantum_tokens < 1:
            raise ValueError(f"decode_quantum_tokens must be >= 1, got {self.config.decode_quantum_tokens}")
        self.quantum = self.config.decode_quantum_tokens
        self._cap = self.config.max_batch_tokens
        self.client_s = self.config.client_step_s * self.quantum
        self.token_bytes = cluster.model.token_id_bytes
        n = len(trace)
        self.routes: list[tuple[int, ...]] = [()] * n
        self.stage_starts: list[tuple[int, ...]] = [()] * n
        self.stage = [0] * n
        self.epoch = [0] * n
        self.generated = [0] * n
        self.out_len = [req.output_tokens for req in trace]
        self.first_token_s = [-1.0] * n
        self.done_s = [-1.0] * n
        self.failovers = 0
        self.restarts = 0
        self.handovers = 0
        self.replayed_tokens = 0  # token x stage: tokens re-prefilled by replacement stages
        self.handover_bytes = 0
        self.replay_end = [0] * n  # a replay's prefill returns to the client before this stage
        self.resume_stage = [0] * n  # after a replay, the pending decode step re-enters here
        self.replaying = [False] * n
        self.stalled: list[tuple[int, int]] = []  # (request, stage) failed over with no route yet
        self.waiting: deque[int] = deque()
        self.admission_blocked = False
        self.buckets: list[int] = []
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = 0
        self._hooks: dict[int, Callable[[], None]] = {}
        for node_id, layers in plan.placement.items():
            self.set_layers(self.index[node_id], layers)

    # -- events ----------------------------------------------------------------------------------------

    def push(self, t: float, kind: int, a: int, b: object = None) -> None:
        # batching.start_iteration and links.send inline these two lines: one event per message, and the call cost 6% of a run.
        self._seq += 1
        heappush(self._heap, (t, self._seq, kind, a, b))

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action` at simulated time t (churn events, reloads)."""
        self._seq += 1
        self._hooks[self._seq] = action
        self.push(t, TIMER, self._seq)

    def run(self) -> Simulation:
        for req in self.trace:
            self.push(req.arrival_s, ARRIVE, req.index)
        heap = self._heap
        while heap:
            t, _, kind, a, b = heappop(heap)
            self.now = t
            if kind == NODE_DONE:
                finish_iteration(self, a, b)  # type: ignore[arg-type]
            elif kind == DELIVER_DECODE:
                node = self.nodes[a]
                if node.alive and node.incarnation == b[0]:  # type: ignore[index]
                    node.decode_q.extend(b[1])  # type: ignore[index]
                    if not node.busy:
                        start_iteration(self, node, a)
            elif kind == CLIENT_DECODE:
                client_arrive(self, CLIENT_DECODE, b)  # type: ignore[arg-type]
            elif kind == DELIVER_PREFILL:
                node = self.nodes[a]
                if node.alive and node.incarnation == b[0]:  # type: ignore[index]
                    queue_prefill(self, node, b[1])  # type: ignore[index]
                    if not node.busy:
                        start_iteration(self, node, a)
            elif kind == CLIENT_PREFILL:
                client_arrive(self, CLIENT_PREFILL, b)  # type: ignore[arg-type]
            elif kind == ARRIVE:
                self.waiting.append(a)
                sessions.try_admit(self)
            elif kind == TIMER:
                self._hooks.pop(a)()
            elif kind == HOST_DONE:
                for proc in b.finish(t, a, self._schedule_host):  # type: ignore[attr-defined]
                    if proc == CLIENT:
                        client_done(self)
                    else:
                        finish_iteration(self, proc, self.nodes[proc].incarnation)
        return self

    def _schedule_host(self, t: float, host: Host, version: int) -> None:
        self.push(t, HOST_DONE, version, host)

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
        node, spec = self.nodes[i], self.cluster.node_by_id[self.ids[i]]
        node.layers = layers
        node.timing = timing = NodeTiming(
            node.id, spec.tokens_s(len(layers)), len(layers), spec.extra, self.config.timing, self._cap
        )
        node.decode_iter_s = [timing.decode_s(b) * self.quantum for b in range(self._cap + 1)]
        node.cache_total = int(spec.extra.get("cache_tokens", self.config.cache_layer_tokens // len(layers)))
        self._announce(node)
        self.admission_blocked = False
        self.retry_stalled()

    def remove(self, i: int) -> list[int]:
        """Node i leaves (or starts reloading). Returns the sessions that were using it."""
        node = self.nodes[i]
        if node.host is not None:
            node.host.cancel(self.now, i, self._schedule_host)
        node.alive, node.incarnation, node.busy = False, node.incarnation + 1, False
        node.decode_q, node.prefill_q, node.cur_decode, node.cur_prefill = [], deque(), [], []
        node.replay_q, node.cur_replay, node.cur_replay_tokens = deque(), [], 0
        node.old_layers, node.draining = None, set()
        self.peers.pop(node.id, None)
        lost, node.sessions = sorted(node.sessions), set()
        return lost

    def _announce(self, node: Node) -> None:
        assert node.layers is not None
        reserve = int((1.0 - self.config.cache_high_water) * node.cache_total)
        self.peers[node.id] = PeerState(
            node.id, node.layers, node.cache_total - node.cache_used, 0.0, 0.0, reserve
        )

    def _queue_prefill(self, node: Node, jobs: list[tuple[int, int]]) -> None:
        queue_prefill(self, node, jobs)  # kept as a method for tests/unit/sim/test_churn_moves.py

    def _take_replays(self, node: Node) -> None:
        take_replays(self, node)  # kept as a method for tests/unit/sim/test_churn_moves.py

    def transfer(self, src: int, dst: int, nbytes: int) -> float:
        """Queue a bulk transfer (a KV cache) on the link src -> dst; returns when it has arrived."""
        return links.transfer(self, src, dst, nbytes)

    # -- sessions --------------------------------------------------------------------------------------

    def session_tokens(self, r: int) -> int:
        return self.trace[r].prompt_tokens + self.trace[r].output_tokens

    def try_admit(self) -> None:
        """Start waiting requests in FIFO order until one finds no route (swarm/sim/sessions.py)."""
        sessions.try_admit(self)

    def fail_over(self, r: int, lost: int) -> None:
        """Node `lost` no longer serves session r: re-route and replay (swarm/sim/sessions.py)."""
        sessions.fail_over(self, r, lost)

    def set_plan(self, plan: Plan) -> None:
        self.plan = plan
        self.router = self.make_router(plan)
        self.admission_blocked = False
        self.retry_stalled()

    def retry_stalled(self) -> None:
        """Sessions that failed over with no route try again (the swarm changed)."""
        if self.stalled:
            stalled, self.stalled = self.stalled, []
            for r, k in stalled:
                moves.resume_stalled(self, r, k)
