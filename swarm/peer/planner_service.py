"""The live planner: while this peer holds the planner lease, keep a good plan published in the DHT.

Each check (every check_interval_s) reads a snapshot and decides, as pure functions of it:
  1. replan?  the period elapsed, membership changed, or a peer's measured speed / memory moved by more than
     change_fraction since the last solve;
  2. how? (swarm.planner.replan) a broken plan is first repaired locally (spares, else neighbours); else, and
     when no repair restores a route, the MILP runs from the current plan, moving at most max_moves peers;
  3. publish? only if the new plan's max flow beats the current plan's (re-evaluated on today's cluster) by
     improve_fraction, or the current plan is broken (a planned peer is gone or cannot hold its range).
  4. re-flow? when links were re-measured (a link's time per token moved by change_fraction and
     LINK_CHANGE_S) or a re-solve found no better placement: the same placement's flows on today's links
     (graph.max_flow: slow links carry only what the max flow needs), published as a new epoch when they
     moved by reflow_fraction of the flow. Nobody moves, and clients route around a link that became slow.
Otherwise the current plan is only refreshed (stored again, same epoch), so clients never see churn. After each
check the planner stores the swarm's summary (membership digest and plan epoch) when either changed, else every
summary_ttl_s / 2: the other peers read only that, and the records when it changes (swarm.dht.watch). Only a
plan we made is refreshed: a predecessor's plan is replaced by our own (epoch + 1), never re-signed, since
re-signing would lend our lease to whatever that plan says.
The solve runs in a niced process of its own (swarm.peer.solver_process), with a time limit; the event
loop keeps serving and renewing the lease meanwhile.

What the planner trusts: the model's shape comes from our own spec (whose hash names the DHT keys), not from
any record; announced speeds and link bandwidths are clamped to PlannerConfig's plausible caps; a peer
reported by min_reporters distinct reporters is left out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from swarm.dht import Directory, Election, PeerRecord, PlanRecord, SwarmSnapshot, excluded_peers
from swarm.dht.directory import membership_digest
from swarm.dht.schemas import SummaryRecord
from swarm.dht.trust import MIN_REPORTERS
from swarm.errors import PlanningError
from swarm.peer.config import PlannerConfig
from swarm.peer.solver_process import InThread, SolverProcess
from swarm.planner import Cluster, ClusterLink, ClusterNode, ModelInfo, max_flow, placement_problems
from swarm.planner.graph import link_cost_s
from swarm.planner.replan import ReplanConfig, publish_reason, replan
from swarm.planner.split import KV_KEY, PREFILL_KEY, SplitConfig, split_plan
from swarm.types import DTYPE_BYTES, SINK, SOURCE, LayerRange, NodeID, Plan, summary_copies

logger = logging.getLogger(__name__)

PLANNED_STATES = ("loading", "serving")  # a loading peer is following the plan: keep it in the cluster
LINK_CHANGE_S = 0.002  # a link's time per token must move by this much too (loopback jitter does not count)


def planned_peers(snapshot: SwarmSnapshot, min_reporters: int = MIN_REPORTERS) -> dict[str, PeerRecord]:
    """Peers the planner may place layers on: loading or serving, with a measured speed and some room, and
    not reported by `min_reporters` distinct reporters."""
    excluded = excluded_peers(snapshot.reports, min_reporters)
    return {
        pid: r
        for pid, r in snapshot.peers.items()
        if r.state in PLANNED_STATES
        and r.decode_layer_tokens_s_b8 > 0
        and r.max_layers > 0
        and pid not in excluded
    }


def announced_model(peers: Mapping[str, PeerRecord]) -> ModelInfo:
    """The model as most peers announce it (ties: the smaller shape), for tools that have no spec at hand.
    A running peer passes its own spec's ModelInfo instead, so no record decides the shape."""
    shapes = Counter((r.num_layers, r.hidden_size, DTYPE_BYTES.get(r.dtype, 2)) for r in peers.values())
    (num_layers, hidden_size, dtype_bytes), _ = min(shapes.items(), key=lambda kv: (-kv[1], kv[0]))
    name = next(r.model_name for r in peers.values() if r.num_layers == num_layers)
    return ModelInfo(name=name, num_layers=num_layers, activation_bytes_per_token=hidden_size * dtype_bytes)


def cluster_from_snapshot(
    snapshot: SwarmSnapshot, config: PlannerConfig, model: ModelInfo | None = None
) -> Cluster | None:
    """The planner's view of the swarm (None when no peer can take layers).

    `model` is the served model from the planner's own spec; peers announcing another layer count are left
    out. tokens_s_by_layers[k-1] = decode_layer_tokens_s_b8 / k: a peer holding k layers runs all k per
    token, with the announced speed clamped to config.max_layer_tokens_s. Links come from the peers' probes,
    each direction from either end (link_one_way), bandwidth clamped to config's cap.
    """
    peers = planned_peers(snapshot, config.min_reporters)
    if not peers:
        return None
    model = model or announced_model(peers)
    peers = {p: r for p, r in peers.items() if r.num_layers == model.num_layers}
    nodes = []
    for pid in sorted(peers):
        record = peers[pid]
        cap = min(record.max_layers, model.num_layers)
        speed = min(record.decode_layer_tokens_s_b8, config.max_layer_tokens_s)
        speeds = tuple(speed / k for k in range(1, cap + 1))
        extra = phase_figures(record, cap, config) if config.split_phases else {}
        nodes.append(
            ClusterNode(
                id=NodeID(pid), region="default", max_layers=cap, tokens_s_by_layers=speeds, extra=extra
            )
        )
    return Cluster(model, tuple(nodes), tuple(_links(nodes, peers, config)))


def phase_figures(record: PeerRecord, cap: int, config: PlannerConfig) -> dict[str, list[float]]:
    """What swarm.planner.split reads of a peer: its prefill tokens/s by layers held (the announced per-layer
    speed / k, clamped like decode's), and its KV tokens per layer by layers held (the cache it announces for
    the layers it holds now, spread over k layers; absent while it holds none)."""
    prefill = min(record.prefill_layer_tokens_s, config.max_layer_tokens_s)
    figures = {PREFILL_KEY: [prefill / k for k in range(1, cap + 1)]}
    held = record.range_end - record.range_start
    if held > 0:
        figures[KV_KEY] = [float(record.cache_tokens_total * held // k) for k in range(1, cap + 1)]
    return figures


def _links(
    nodes: list[ClusterNode], peers: Mapping[str, PeerRecord], config: PlannerConfig
) -> list[ClusterLink]:
    links: list[ClusterLink] = []
    for node in nodes:
        links.append(ClusterLink(SOURCE, node.id, config.client_bandwidth_bytes_s, config.client_latency_s))
        links.append(ClusterLink(node.id, SINK, config.client_bandwidth_bytes_s, config.client_latency_s))
        for other in nodes:
            if other.id == node.id:
                continue
            measured = link_one_way(peers[node.id], peers[other.id])
            if measured is not None:
                rtt_s, bandwidth = measured
                bandwidth = min(bandwidth, config.max_link_bandwidth_bytes_s)
                links.append(ClusterLink(node.id, other.id, bandwidth, rtt_s / 2))
            elif config.unmeasured_bandwidth_bytes_s is not None:
                bandwidth = config.unmeasured_bandwidth_bytes_s
                links.append(ClusterLink(node.id, other.id, bandwidth, config.unmeasured_latency_s))
    return links


def link_one_way(src: PeerRecord, dst: PeerRecord) -> tuple[float, float] | None:
    """(rtt_s, bandwidth_bytes_s) of the link src -> dst as announced: src's own measurement of its sending
    side, else dst's measurement of its receiving side, else (a record from before both directions were
    measured) the other direction, assumed symmetric. None when neither peer measured the pair."""
    ours, theirs = src.links.get(dst.peer_id), dst.links.get(src.peer_id)
    if ours is not None:
        return ours.rtt_s, ours.bandwidth_bytes_s
    if theirs is not None:
        return theirs.rtt_s, theirs.reverse_bandwidth_bytes_s or theirs.bandwidth_bytes_s
    return None


def measurements_changed(before: Cluster | None, now: Cluster, change_fraction: float) -> str | None:
    """Why the swarm changed enough to re-solve since `before` (None: it did not)."""
    if before is None:
        return "first solve"
    old, new = before.node_by_id, now.node_by_id
    if set(old) != set(new):
        joined, left = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        return f"membership changed (joined {joined}, left {left})"
    if before.model != now.model:
        return "model changed"
    for node_id, node in new.items():
        prev = old[node_id]
        if node.max_layers != prev.max_layers:
            return f"{node_id} can now hold {node.max_layers} layers (was {prev.max_layers})"
        a, b = prev.tokens_s_by_layers[0], node.tokens_s_by_layers[0]
        if abs(b - a) > change_fraction * max(a, 1e-9):
            return f"{node_id} speed moved {a:.0f} -> {b:.0f} tokens/s"
    return None


def links_changed(before: Cluster | None, now: Cluster, change_fraction: float) -> str | None:
    """Which link between peers moved enough since `before` to re-flow the plan (None: none did)."""
    if before is None:
        return None
    old = before.link_by_pair
    for pair in now.link_by_pair:
        if pair not in old:
            return f"link {pair[0]} -> {pair[1]} measured"
        a, b = link_cost_s(before, *pair), link_cost_s(now, *pair)
        if abs(b - a) > max(change_fraction * a, LINK_CHANGE_S):
            return f"link {pair[0]} -> {pair[1]} moved {a * 1e3:.1f} -> {b * 1e3:.1f} ms per token"
    return None


def reflow(
    cluster: Cluster, current: Plan, fraction: float, give: float = 0.0, split: SplitConfig | None = None
) -> tuple[Plan | None, str]:
    """The current placement with its flows on `cluster`'s links (slow links kept to what the fast ones lack
    for 1 - `give` of the max flow; with `split`, prefill and decode as two flows where that pays), when those
    moved by more than `fraction` of the flow (None otherwise), and why."""
    fresh = max_flow(cluster, current.placement, current.method, give=give)
    if split is not None:
        fresh = split_plan(cluster, fresh, split, other_placements=False)
    old = _flows_by_edge(current)
    new = _flows_by_edge(fresh)
    # A token that changes paths leaves one edge for another: half the summed change, against the flow.
    moved = sum(abs(new.get(e, 0.0) - old.get(e, 0.0)) for e in old.keys() | new.keys()) / 2
    total = max(current.max_flow_tokens_s, fresh.max_flow_tokens_s)
    if current.decode_flows or fresh.decode_flows:  # two kinds: against the tokens/s of both entering
        total = max(sum(v for e, v in flows.items() if e[1] == SOURCE) for flows in (old, new))
    if total <= 0 or moved / total <= fraction:
        return None, "flows unchanged"
    return fresh, f"flows re-routed on re-measured links ({moved / total:.0%} of the flow moved)"


def _flows_by_edge(plan: Plan) -> dict[tuple[str, NodeID, NodeID], float]:
    flows = {("one", f.src, f.dst): f.tokens_s for f in plan.flows}
    return flows | {("decode", f.src, f.dst): f.tokens_s for f in plan.decode_flows}


def current_plan_problem(cluster: Cluster, current: Plan) -> str | None:
    """Why the published plan cannot serve this cluster any more (None: it still can)."""
    gone = sorted(n for n in current.placement if n not in cluster.node_by_id)
    if gone:
        return f"planned peers gone: {gone}"
    problems = placement_problems(cluster, current.placement)
    return "; ".join(problems) if problems else None


def should_publish(
    cluster: Cluster, current: Plan | None, candidate: Plan, improve_fraction: float
) -> str | None:
    """Why `candidate` should replace the published plan (None: keep the current one, no thrashing)."""
    return publish_reason(cluster, current.placement if current else None, candidate, improve_fraction)


def split_config(config: PlannerConfig) -> SplitConfig:
    return SplitConfig(
        prompt_tokens_per_output=config.split_prompt_tokens_per_output,
        session_tokens_s=config.split_session_tokens_s,
        min_gain=config.split_min_gain,
    )


def replan_config(config: PlannerConfig) -> ReplanConfig:
    return ReplanConfig(
        method=config.method,
        time_limit_s=config.solve_time_limit_s,
        max_moves=config.max_moves,
        move_cost_fraction=config.move_cost_fraction,
        reload_cost_tokens_s=config.reload_cost_tokens_s,
        spare_replicas=config.spare_replicas,
        gain_fraction=config.improve_fraction,
    )


class PlannerService:
    """Runs beside the Election: plans only while `election.is_leader`."""

    def __init__(
        self,
        directory: Directory,
        election: Election,
        config: PlannerConfig | None = None,
        model: ModelInfo | None = None,
        solver: SolverProcess | InThread | None = None,
    ) -> None:
        """`model`: the served model from our own spec (None: as most peers announce it). `solver`: where
        solves run (default: a niced process of their own, so serving never waits for one)."""
        self.directory = directory
        self.election = election
        self.config = config or PlannerConfig()
        self.model = model
        self.solver = solver or SolverProcess()
        self._solved_cluster: Cluster | None = None
        self._flowed_cluster: Cluster | None = None  # the cluster our latest plan's flows were computed on
        self._solved_at = float("-inf")
        self._refreshed_at = float("-inf")
        self._mine: PlanRecord | None = None  # the newest plan we stored
        self.published = 0  # plans published with a new epoch by this peer (for tests and status)
        self._term_began = True  # our first check since we took the lease reads the plan key
        self._summarized: tuple[str, int] | None = None  # (membership digest, epoch) of our last summary
        self._summarized_at = float("-inf")

    async def run(self) -> None:
        try:
            while True:
                if self.election.is_leader:
                    try:
                        await self.check()
                    except Exception as e:  # a bad snapshot or a solver failure must not stop planning
                        logger.warning("planner check failed: %r", e)
                else:
                    self._solved_cluster = None  # a new term starts from a fresh look at the swarm
                    self._flowed_cluster = None
                    self._term_began = True
                await asyncio.sleep(self.config.check_interval_s)
        finally:
            self.solver.close()

    async def check(self) -> PlanRecord | None:
        """One look at the swarm: re-solve if needed, publish if better, else refresh; then tell the swarm's
        summary readers (swarm.dht.watch) what we saw. Returns the plan stored, if any."""
        # Within a term we know our own plan (``_mine``): the plan key, which grows with the swarm, is not
        # read again at every check.
        snapshot = await self.directory.snapshot(plans=self._term_began or self._mine is None)
        self._term_began = False
        try:
            return await self._plan(snapshot)
        finally:  # a failed solve must not leave the summary to expire (everyone would read every record)
            await self._summarize(snapshot)

    async def _summarize(self, snapshot: SwarmSnapshot) -> None:
        """Store the summary of ``snapshot`` and our plan's epoch when either changed, else every
        summary_refresh_s (a failed store is retried at the next check)."""
        me = self.directory.peer_id
        epochs = [self._mine.epoch if self._mine is not None else 0]
        if snapshot.plan is not None and snapshot.plan.planner_peer_id == me:
            epochs.append(snapshot.plan.epoch)
        version = (membership_digest(snapshot.peers), max(epochs))
        refresh_s = self.directory.config.summary_refresh_s
        if version == self._summarized and time.monotonic() - self._summarized_at < refresh_s:
            return
        summary = SummaryRecord(
            planner_peer_id=me,
            plan_epoch=version[1],
            peers_digest=version[0],
            peer_count=len(snapshot.peers),
            created_at=self.directory.now(),
            copies=summary_copies(len(snapshot.peers)),
        )
        try:
            async with asyncio.timeout(self.directory.write_timeout_s):
                stored = await self.directory.publish_summary(summary)
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.warning("could not store the swarm summary: %r", e)
            return
        if stored:
            self._summarized, self._summarized_at = version, time.monotonic()

    async def _plan(self, snapshot: SwarmSnapshot) -> PlanRecord | None:
        me = self.directory.peer_id
        live = snapshot.plan if snapshot.plan is not None and snapshot.plan.planner_peer_id == me else None
        if self._mine is not None and (live is None or self._mine.epoch > live.epoch):
            live = self._mine  # our newest plan may not have reached the nodes we read from yet
        cluster = cluster_from_snapshot(snapshot, self.config, self.model)
        current = live.to_plan() if live is not None else None  # a predecessor's plan is replaced, not kept
        # Continue from the newest epoch the swarm accepted (a predecessor's too), so followers move on.
        epoch = max(live.epoch if live is not None else 0, self.directory.accepted_epoch or 0)
        if cluster is None:
            logger.info("no peer can hold layers yet; nothing to plan")
            return None
        reason = measurements_changed(self._solved_cluster, cluster, self.config.change_fraction)
        if reason is None and time.monotonic() - self._solved_at >= self.config.period_s:
            reason = "periodic re-solve"
        if reason is None and current is None:
            reason = "no plan of ours yet"
        if current is not None and current_plan_problem(cluster, current) is not None:
            reason = "the current plan is broken"  # repaired first, whatever else changed
        if reason is not None:
            candidate, why = await self._solve(cluster, snapshot.peers, current, reason)
            if candidate is not None:
                self._flowed_cluster = cluster
                give = self.config.slow_flow_give
                flowed = await asyncio.to_thread(
                    max_flow, cluster, candidate.placement, candidate.method, give=give
                )
                given = replace(candidate, flows=flowed.flows, max_flow_tokens_s=flowed.max_flow_tokens_s)
                return await self._publish(await self._phases(cluster, given), epoch + 1, why)
        relinked = links_changed(self._flowed_cluster, cluster, self.config.change_fraction)
        if current is not None and (reason or relinked) and current_plan_problem(cluster, current) is None:
            self._flowed_cluster = cluster
            split = split_config(self.config) if self.config.split_phases else None
            candidate, why = await asyncio.to_thread(
                reflow, cluster, current, self.config.reflow_fraction, self.config.slow_flow_give, split
            )
            if candidate is not None:
                return await self._publish(candidate, epoch + 1, f"{why}: {relinked or reason}")
        if live is not None and time.monotonic() - self._refreshed_at >= self.config.period_s:
            return await self._refresh(live)
        return None

    async def _solve(
        self, cluster: Cluster, peers: Mapping[str, PeerRecord], current: Plan | None, reason: str
    ) -> tuple[Plan | None, str]:
        """(the plan to publish, why), or (None, why not): swarm.planner.replan in the solver process."""
        # From the published plan; before the first one, from what peers hold (so join ranges are kept).
        start = current.placement if current is not None else self._held(cluster, peers)
        logger.info("re-planning %d peers: %s", len(cluster.nodes), reason)
        limit_s = self.config.solve_time_limit_s
        try:
            async with asyncio.timeout(limit_s * 2 + 10):  # the solver honours its limit; this is a backstop
                plan, why = await self.solver.run(
                    replan, cluster, start or None, replan_config(self.config), current is None
                )
        except PlanningError as e:
            logger.warning("cannot plan yet: %s", e)
            return None, str(e)
        finally:
            self._solved_cluster, self._solved_at = cluster, time.monotonic()
        return plan, why

    @staticmethod
    def _held(cluster: Cluster, peers: Mapping[str, PeerRecord]) -> dict[NodeID, LayerRange]:
        """What peers hold now, from their records."""
        return {
            NodeID(pid): LayerRange(r.range_start, r.range_end)
            for pid, r in peers.items()
            if NodeID(pid) in cluster.node_by_id and r.range_end > r.range_start
        }

    async def _phases(self, cluster: Cluster, plan: Plan) -> Plan:
        """With split_phases: the plan's placement with prefill and decode as two flows where that pays
        (swarm.planner.split), else the plan as it is."""
        if not self.config.split_phases:
            return plan
        return await asyncio.to_thread(split_plan, cluster, plan, split_config(self.config), False)

    async def _publish(self, plan: Plan, epoch: int, why: str) -> PlanRecord:
        plan = Plan(
            method=plan.method,
            placement=plan.placement,
            max_flow_tokens_s=plan.max_flow_tokens_s,
            flows=plan.flows,
            upper_bound_tokens_s=plan.upper_bound_tokens_s,
            solve_s=plan.solve_s,
            epoch=epoch,
            decode_flows=plan.decode_flows,
        )
        record = PlanRecord(
            epoch=epoch,
            planner_peer_id=self.directory.peer_id,
            plan=plan.to_json(),
            created_at=self.directory.dht.now(),
        )
        if not await self.directory.publish_plan(record):
            logger.warning("no DHT node accepted plan epoch %d", epoch)
        self.published += 1
        self._mine = record
        self._refreshed_at = time.monotonic()
        logger.info("published plan epoch %d (%.1f tokens/s): %s", epoch, plan.max_flow_tokens_s, why)
        return record

    async def _refresh(self, current: PlanRecord) -> PlanRecord:
        """Store our live plan again (same epoch), pushing its expiry on. Only a plan we made: signing someone
        else's would vouch for a placement we never checked."""
        if current.planner_peer_id != self.directory.peer_id:
            raise ValueError(f"refusing to re-sign a plan made by {current.planner_peer_id}")
        await self.directory.publish_plan(current)
        self._refreshed_at = time.monotonic()
        self._mine = current
        return current
