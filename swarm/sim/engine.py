"""The discrete-event serving simulation (one heapq of timed events).

What is modelled, and how:
* Requests arrive (trace), get a route from swarm.routing's Router over the plan (the same masking the
  client uses: session tokens = prompt + output against each peer's free KV cache below its high-water
  mark), reserve that cache on every stage, and wait in FIFO order while no route exists.
* A prefill travels the route stage by stage; the LM head runs on the client; then every decode step sends
  one token through all stages again, until the request's output length is reached.
* Each node runs iterations back to back while it has work (continuous batching): every decode token waiting
  when an iteration starts joins it, plus prefill jobs up to a token budget. Iteration time comes from the
  node's timing model (swarm/sim/timing.py).
* Each directed link is a FIFO pipe: a message waits for the previous one to finish sending, takes
  bytes / bandwidth to send, then arrives `latency_s` later. A node's outputs for the same next hop travel as
  one message.
* Nodes may share a host's cores with other nodes and the client (swarm/sim/hosts.py): their iterations
  then slow down by processor sharing while more processes than cores are busy. The client on a host is one
  process that handles arriving outputs one message at a time (LM head + sampling, client_step_s per token);
  without a host, client_step_s is a plain delay (many independent clients).
* Churn (swarm/sim/churn.py) removes, adds and moves nodes; sessions on a lost node fail over. With
  SimConfig.partial_replay (swarm/sim/moves.py) only the lost stage is re-routed and replayed, and a session
  with no route waits; without it the rest of the route is rebuilt with Router.route_from and the prefix
  (prompt + generated tokens) replayed into all new stages, as the client did before issue 13. KV hand-over
  and make before break are in swarm/sim/moves.py and churn.py. Replays are prefilled in chunks of
  replay_chunk_tokens per iteration next to the decode batch (0: whole, like any prefill).

Per event the work is O(log n) for the heap plus O(1) per token carried. Hot loops use plain lists and ints.
Tokens in flight are tagged with the request's failover epoch (key = request << 8 | epoch), so tokens of a
session that failed over are dropped wherever they are, in O(1).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heappop, heappush

from swarm.errors import NoRouteError
from swarm.planner.cluster import Cluster
from swarm.routing import PeerState, Router, RoutingView
from swarm.sim import moves
from swarm.sim.hosts import CLIENT, Host, hosts_of
from swarm.sim.timing import NodeTiming, TimingDefaults
from swarm.sim.trace import Request
from swarm.types import SINK, SOURCE, LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)

ARRIVE, NODE_DONE, DELIVER_DECODE, DELIVER_PREFILL, CLIENT_DECODE, CLIENT_PREFILL, TIMER, HOST_DONE = range(8)
SRC, SNK = -1, -2  # link endpoints for the client side


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


class Node:
    __slots__ = (
        "id", "alive", "incarnation", "layers", "timing", "cache_total", "cache_used", "decode_q", "prefill_q",
        "busy", "cur_decode", "cur_prefill", "busy_s", "sessions", "host", "decode_iter_s",
        "replay_q", "cur_replay", "cur_replay_tokens", "old_layers", "draining",
    )  # fmt: skip

    def __init__(self, node_id: NodeID) -> None:
        self.id = node_id
        self.alive = False
        self.incarnation = 0
        self.layers: LayerRange | None = None
        self.timing: NodeTiming | None = None
        self.cache_total = 0
        self.cache_used = 0
        self.decode_q: list[int] = []
        self.prefill_q: deque[tuple[int, int]] = deque()
        self.busy = False
        self.cur_decode: list[int] = []
        self.cur_prefill: list[tuple[int, int]] = []
        self.busy_s = 0.0
        self.sessions: set[int] = set()
        self.host: Host | None = None
        self.decode_iter_s: list[float] = []  # seconds of a decode-only iteration of b tokens, b <= batch cap
        self.replay_q: deque[list[int]] = deque()  # [key, tokens left, tokens]: replays, chunked
        self.cur_replay: list[tuple[int, int]] = []  # replays whose last chunk runs in this iteration
        self.cur_replay_tokens = 0
        self.old_layers: LayerRange | None = None  # layers still served to `draining` after a move
        self.draining: set[int] = set()


class Link:
    __slots__ = ("src", "dst", "bandwidth_bytes_s", "latency_s", "free_at", "wait_s", "messages")

    def __init__(self, src: int, dst: int, bandwidth_bytes_s: float, latency_s: float) -> None:
        self.src, self.dst = src, dst  # node indices, or SRC / SNK for the client's side
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.latency_s = latency_s
        self.free_at = 0.0
        self.wait_s = 0.0
        self.messages = 0


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
        # _start and _send inline these two lines: one event per message, and the call cost 6% of a run.
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
                self._node_done(a, b)  # type: ignore[arg-type]
            elif kind == DELIVER_DECODE:
                node = self.nodes[a]
                if node.alive and node.incarnation == b[0]:  # type: ignore[index]
                    node.decode_q.extend(b[1])  # type: ignore[index]
                    if not node.busy:
                        self._start(node, a)
            elif kind == CLIENT_DECODE:
                self._client_arrive(CLIENT_DECODE, b)  # type: ignore[arg-type]
            elif kind == DELIVER_PREFILL:
                node = self.nodes[a]
                if node.alive and node.incarnation == b[0]:  # type: ignore[index]
                    self._queue_prefill(node, b[1])  # type: ignore[index]
                    if not node.busy:
                        self._start(node, a)
            elif kind == CLIENT_PREFILL:
                self._client_arrive(CLIENT_PREFILL, b)  # type: ignore[arg-type]
            elif kind == ARRIVE:
                self.waiting.append(a)
                self.try_admit()
            elif kind == TIMER:
                self._hooks.pop(a)()
            elif kind == HOST_DONE:
                for proc in b.finish(t, a, self._schedule_host):  # type: ignore[attr-defined]
                    if proc == CLIENT:
                        self._client_done()
                    else:
                        self._node_done(proc, self.nodes[proc].incarnation)
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
        if self.config.replay_chunk_tokens <= 0:
            node.prefill_q.extend(jobs)
            return
        for key, tokens in jobs:
            if self.replaying[key >> 8]:
                node.replay_q.append([key, tokens, tokens])
            else:
                node.prefill_q.append((key, tokens))

    def _take_replays(self, node: Node) -> None:
        """Up to replay_chunk_tokens of replays join this iteration (chunked prefill): decode keeps going."""
        left, taken, finished = self.config.replay_chunk_tokens, 0, []
        while node.replay_q and left > 0:
            job = node.replay_q[0]
            take = min(job[1], left)
            job[1] -= take
            left -= take
            taken += take
            if job[1] == 0:
                node.replay_q.popleft()
                finished.append((job[0], job[2]))
        node.cur_replay, node.cur_replay_tokens = finished, taken

    def _start(self, node: Node, i: int) -> None:
        if node.prefill_q:
            budget, tokens = self.config.prefill_budget_tokens, 0
            jobs: list[tuple[int, int]] = []
            while node.prefill_q and (not jobs or tokens + node.prefill_q[0][1] <= budget):
                job = node.prefill_q.popleft()
                jobs.append(job)
                tokens += job[1]
            node.cur_prefill = jobs
        if node.replay_q:
            self._take_replays(node)
        if not node.cur_prefill and not node.cur_replay_tokens and not node.decode_q:
            return
        cap, queued = self._cap, node.decode_q
        if len(queued) > cap:
            node.cur_decode, node.decode_q = queued[:cap], queued[cap:]
        else:
            node.cur_decode, node.decode_q = queued, []
        timing = node.timing
        assert timing is not None
        iter_s = node.decode_iter_s
        if node.cur_prefill or node.cur_replay_tokens:
            dt = timing.prefill_s(sum(t for _, t in node.cur_prefill) + node.cur_replay_tokens)
            if node.cur_decode:  # decode tokens ride along; the fixed per-iteration cost is paid once
                dt += max(iter_s[len(node.cur_decode)] - iter_s[0], 0.0)
        else:
            dt = iter_s[len(node.cur_decode)]
        if timing.forward_s:
            dt += timing.forward_s * self._forwarded(node)
        node.busy = True
        node.busy_s += dt
        if node.host is None:
            self._seq += 1
            heappush(self._heap, (self.now + dt, self._seq, NODE_DONE, i, node.incarnation))
        else:
            node.host.start(self.now, i, dt, self._schedule_host)

    def _forwarded(self, node: Node) -> int:
        """Sessions of the iteration about to run whose next hop is another node (one RPC each)."""
        stage, routes = self.stage, self.routes
        decode = sum(1 for key in node.cur_decode if stage[key >> 8] + 1 < len(routes[key >> 8]))
        prefill = sum(1 for key, _ in node.cur_prefill if stage[key >> 8] + 1 < len(routes[key >> 8]))
        return decode * self.quantum + prefill

    def _node_done(self, i: int, incarnation: int) -> None:
        node = self.nodes[i]
        if not node.alive or node.incarnation != incarnation:
            return
        node.busy = False
        epoch, stage, routes = self.epoch, self.stage, self.routes
        # One token is the common case in a big, lightly loaded cluster: skipping the grouping below saves 23%
        # of a random1000 run (27 vs 35 s for 4,000 requests).
        if len(node.cur_decode) == 1:
            key = node.cur_decode[0]
            r = key >> 8
            if key & 255 == epoch[r] & 255:
                s = stage[r] + 1
                route = routes[r]
                stage[r] = s
                self._send(
                    i,
                    route[s] if s < len(route) else SNK,
                    self.act_bytes * self.quantum,
                    node.cur_decode,
                    False,
                )
            node.cur_decode = []
        elif node.cur_decode:
            groups: dict[int, list[int]] = {}
            for key in node.cur_decode:
                r = key >> 8
                if key & 255 != epoch[r] & 255:
                    continue  # the session failed over while this token was here
                s = stage[r] + 1
                route = routes[r]
                nxt = route[s] if s < len(route) else SNK
                stage[r] = s
                group = groups.get(nxt)
                if group is None:
                    groups[nxt] = [key]
                else:
                    group.append(key)
            for nxt, keys in groups.items():
                self._send(i, nxt, len(keys) * self.act_bytes * self.quantum, keys, False)
            node.cur_decode = []
        if node.cur_prefill or node.cur_replay:
            for key, tokens in node.cur_prefill + node.cur_replay:
                r = key >> 8
                if key & 255 != epoch[r] & 255:
                    continue
                s = stage[r] + 1
                stage[r] = s
                if s >= len(routes[r]):
                    self._send(i, SNK, tokens * self.act_bytes, [(key, tokens)], True)
                elif s >= self.replay_end[r]:  # a partial replay: the next stage kept its cache
                    self._send(i, SNK, self.token_bytes, [(key, tokens)], True)
                else:
                    self._send(i, routes[r][s], tokens * self.act_bytes, [(key, tokens)], True)
            node.cur_prefill, node.cur_replay, node.cur_replay_tokens = [], [], 0
        self._start(node, i)

    # -- links -----------------------------------------------------------------------------------------

    def _new_link(self, src: int, dst: int) -> Link:
        a = SOURCE if src == SRC else self.ids[src]
        b = SINK if dst == SNK else self.ids[dst]
        spec = self.cluster.link_by_pair.get((a, b))
        if spec is None or spec.bandwidth_bytes_s <= 0:
            bandwidth, latency = (
                self.config.missing_link_bandwidth_bytes_s,
                self.config.missing_link_latency_s,
            )
        else:
            bandwidth, latency = spec.bandwidth_bytes_s, spec.latency_s
        link = self.links[(src + 2) * self._link_stride + dst + 2] = Link(src, dst, bandwidth, latency)
        return link

    def transfer(self, src: int, dst: int, nbytes: int) -> float:
        """Queue a bulk transfer (a KV cache) on the link src -> dst; returns when it has arrived."""
        link = self.links.get((src + 2) * self._link_stride + dst + 2) or self._new_link(src, dst)
        start = max(link.free_at, self.now)
        link.wait_s += start - self.now
        link.messages += 1
        link.free_at = start + nbytes / link.bandwidth_bytes_s
        return link.free_at + link.latency_s

    def _send(
        self, src: int, dst: int, nbytes: int, payload: list, prefill: bool, delay_s: float = 0.0
    ) -> None:  # type: ignore[type-arg]
        link = self.links.get((src + 2) * self._link_stride + dst + 2)
        if link is None:
            link = self._new_link(src, dst)
        now = self.now + delay_s
        start = link.free_at if link.free_at > now else now
        link.wait_s += start - now
        link.messages += 1
        link.free_at = start + nbytes / link.bandwidth_bytes_s
        arrive = link.free_at + (link.latency_s if prefill else link.latency_s * self.quantum)
        self._seq += 1
        event: tuple[float, int, int, int, object]
        if dst == SNK:
            event = (arrive, self._seq, CLIENT_PREFILL if prefill else CLIENT_DECODE, 0, payload)
        else:
            inc = self.nodes[dst].incarnation
            event = (arrive, self._seq, DELIVER_PREFILL if prefill else DELIVER_DECODE, dst, (inc, payload))
        heappush(self._heap, event)

    # -- the client ------------------------------------------------------------------------------------

    def _client_arrive(self, kind: int, payload: list) -> None:  # type: ignore[type-arg]
        if self.client_host is None:  # many independent clients: the head's time is a delay on the send
            if kind == CLIENT_DECODE:
                self._client_decode(payload, self.client_s)
            else:
                self._client_prefill(payload, self.client_s)
            return
        self.client_q.append((kind, payload))
        if not self.client_busy:
            self._client_next()

    def _client_next(self) -> None:
        """The client process takes the next arrived message: client_step_s per token it carries."""
        kind, payload = self.client_q[0]
        work_s = len(payload) * (self.client_s if kind == CLIENT_DECODE else self.config.client_step_s)
        self.client_busy = True
        assert self.client_host is not None
        self.client_host.start(self.now, CLIENT, work_s, self._schedule_host)

    def _client_done(self) -> None:
        kind, payload = self.client_q.popleft()
        self.client_busy = False
        if kind == CLIENT_DECODE:
            self._client_decode(payload, 0.0)
        else:
            self._client_prefill(payload, 0.0)
        if self.client_q and not self.client_busy:
            self._client_next()

    def _client_decode(self, keys: list[int], delay_s: float) -> None:
        epoch, gen, stage, routes = self.epoch, self.generated, self.stage, self.routes
        out_len = self.out_len
        groups: dict[int, list[int]] = {}
        counted = 0
        for key in keys:
            r = key >> 8
            if key & 255 != epoch[r] & 255:
                continue
            step = min(self.quantum, out_len[r] - gen[r])
            counted += step
            gen[r] += step
            if gen[r] >= out_len[r]:
                self._finish(r)
                continue
            stage[r] = 0
            first = routes[r][0]
            group = groups.get(first)
            if group is None:
                groups[first] = [key]
            else:
                group.append(key)
        self._count(counted)
        for first, group in groups.items():
            self._send(SRC, first, len(group) * self.token_bytes * self.quantum, group, False, delay_s)

    def _client_prefill(self, jobs: list[tuple[int, int]], delay_s: float) -> None:
        for key, _ in jobs:
            r = key >> 8
            if key & 255 != self.epoch[r] & 255:
                continue
            if self.generated[r] == 0:  # the prompt's last position gives the first output token
                self.generated[r] = 1
                self.first_token_s[r] = self.now
                self._count(1)
                if self.generated[r] >= self.out_len[r]:
                    self._finish(r)
                    continue
            # The pending decode step re-enters where the replay began (0 unless a partial replay).
            rs = self.resume_stage[r]
            self.stage[r], self.resume_stage[r], self.replaying[r] = rs, 0, False
            per_token = self.token_bytes if rs == 0 else self.act_bytes
            self._send(SRC, self.routes[r][rs], per_token * self.quantum, [key], False, delay_s)

    def _count(self, tokens: int) -> None:
        b = int(self.now / self.config.bucket_s)
        while len(self.buckets) <= b:
            self.buckets.append(0)
        self.buckets[b] += tokens

    # -- sessions --------------------------------------------------------------------------------------

    def session_tokens(self, r: int) -> int:
        return self.trace[r].prompt_tokens + self.trace[r].output_tokens

    def try_admit(self) -> None:
        """Start waiting requests in FIFO order until one finds no route (then wait for cache to free up)."""
        while self.waiting and not self.admission_blocked:
            r = self.waiting[0]
            try:
                route = self.router.build(self.view, self.session_tokens(r))
            except NoRouteError:
                self.admission_blocked = True
                return
            self.waiting.popleft()
            self._begin(r, [self.index[s.peer_id] for s in route], [s.layers.start for s in route], 0)

    def _begin(self, r: int, nodes: list[int], starts: list[int], from_stage: int) -> None:
        """Reserve cache on stages from_stage.. and send the prompt (plus any replayed tokens) into them."""
        need = self.session_tokens(r)
        for i in nodes[from_stage:]:
            node = self.nodes[i]
            node.cache_used += need
            node.sessions.add(r)
            self._announce(node)
        self.routes[r], self.stage_starts[r] = tuple(nodes), tuple(starts)
        self.stage[r] = from_stage
        self.replay_end[r] = len(nodes)
        self.replaying[r] = self.generated[r] > 0
        if self.generated[r] > 0:
            self.replayed_tokens += (self.trace[r].prompt_tokens + self.generated[r]) * (
                len(nodes) - from_stage
            )
        self.epoch[r] += 1
        key = r << 8 | (self.epoch[r] & 255)
        tokens = self.trace[r].prompt_tokens + self.generated[r]
        per_token = self.token_bytes if from_stage == 0 else self.act_bytes  # mid-route replays hidden states
        self._send(SRC, nodes[from_stage], tokens * per_token, [(key, tokens)], True)

    def _release(self, r: int, from_stage: int = 0) -> None:
        need = self.session_tokens(r)
        for i in self.routes[r][from_stage:]:
            node = self.nodes[i]
            if r in node.sessions:
                node.sessions.discard(r)
                node.cache_used -= need
                if node.draining:
                    node.draining.discard(r)
                    if not node.draining:
                        node.old_layers = None  # make before break: the old range is dropped now
                if node.alive:
                    self._announce(node)
        self.admission_blocked = False

    def _finish(self, r: int) -> None:
        self.done_s[r] = self.now
        self._release(r)
        self.try_admit()

    def fail_over(self, r: int, lost: int) -> None:
        """Node `lost` no longer serves session r: re-route and replay (swarm/sim/moves.py when partial)."""
        if self.done_s[r] >= 0:
            return
        if self.config.partial_replay:
            moves.fail_over_partial(self, r, lost)
            return
        self.failovers += 1
        nodes = list(self.routes[r])
        k = nodes.index(lost)
        self.epoch[r] += 1  # tokens of r in flight anywhere are now stale
        if self.generated[r] > 0:
            start = self.stage_starts[r][k]
            prev = self.ids[nodes[k - 1]] if k > 0 else SOURCE
            self._release(r, k)
            try:
                tail = self.router.route_from(self.view, start, prev, self.session_tokens(r))
            except NoRouteError:
                pass
            else:
                self._begin(
                    r,
                    nodes[:k] + [self.index[s.peer_id] for s in tail],
                    list(self.stage_starts[r][:k]) + [s.layers.start for s in tail],
                    k,
                )
                return
        # Still prefilling, or no way round the lost node: start over from the prompt when a route frees up.
        self._release(r)
        self.restarts += 1
        self.waiting.appendleft(r)
        self.try_admit()

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
