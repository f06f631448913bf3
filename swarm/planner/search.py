"""Simulated annealing over (first layer, layer count) per node.

Why this and not only the MILP: HiGHS on the literal Helix MILP finds poor placements slowly (see milp.py),
while a plain annealer on the coverage score is fast and strong. The state is one range per node (count 0 =
idle); moves are shift, grow, shrink, move a boundary shared with an abutting node (both change, so no
hole opens), swap two nodes' ranges, and "cover the bottleneck" (move a node onto the weakest layer).
Only states that hold every layer are accepted, so the result is always valid. The objective is

    flow(placement) - reload_cost_tokens_s * (layers nodes must load anew vs. `current`)

where flow is the coverage score in one fast region (it equals the max flow there, and updates
incrementally in O(layers)), and the exact max flow (fastflow.py) when slow links between regions bind.
For the exact score we use that coverage bounds the flow from above: a candidate is rejected without
solving a max flow whenever even its coverage cannot pass the Metropolis threshold.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np

from swarm.planner.cluster import Cluster
from swarm.planner.fastflow import FlowScorer
from swarm.planner.graph import upper_bound
from swarm.planner.placement import Placement, repair
from swarm.types import LayerRange, NodeID


@dataclass(frozen=True)
class SearchConfig:
    time_limit_s: float = 10.0  # wall-clock budget
    max_iters: int = 2_000_000  # move budget (tests use this for determinism)
    seed: int = 0
    reload_cost_tokens_s: float = 0.0  # objective penalty per layer a node must load anew
    exact_flow: bool | None = None  # None: exact max flow only when the cluster spans several regions
    start_temperature: float = 0.02  # relative to the cluster's upper bound
    end_temperature: float = 1e-5
    tie_weight: float = 0.0  # see _State.smooth_coverage; relative to bound / layers
    objective: str = "min"  # "min", or "shortfall" (coverage mode; measured worse on the Helix clusters)
    target_step: float = 0.005  # shortfall target = best minimum * (1 + this)


class _State:
    """Ranges of the usable nodes plus the per-layer coverage, updated incrementally."""

    def __init__(self, cluster: Cluster, ids: list[NodeID], placement: Placement) -> None:
        self.num_layers = cluster.model.num_layers
        self.caps = [cluster.layer_cap(cluster.node_by_id[i]) for i in ids]
        self.tables = [(0.0, *cluster.node_by_id[i].tokens_s_by_layers) for i in ids]
        self.starts = [placement[i].start if i in placement else 0 for i in ids]
        self.counts = [len(placement[i]) if i in placement else 0 for i in ids]
        self.cov = np.zeros(self.num_layers)  # numpy: slice updates and min run in C
        for i in range(len(ids)):
            self._apply(i, +1.0)

    def _apply(self, i: int, sign: float) -> None:
        if self.counts[i]:
            self.cov[self.starts[i] : self.starts[i] + self.counts[i]] += (
                sign * self.tables[i][self.counts[i]]
            )

    def set(self, i: int, start: int, count: int) -> None:
        self._apply(i, -1.0)
        self.starts[i], self.counts[i] = start, count
        self._apply(i, +1.0)

    def coverage(self) -> float:
        low = float(self.cov.min())
        # Float drift can leave a bare layer at 1e-12; anything that small is "not covered".
        return low if low > 1e-6 else 0.0

    def smooth_coverage(self, tie_weight: float) -> float:
        """Coverage minus a small charge per layer near the minimum: among equal bottlenecks, prefer fewer
        bottleneck layers, which gives the annealer a slope on the plateaus of the plain minimum."""
        low = self.coverage()
        if low == 0.0 or tie_weight == 0.0:
            return low
        return low - tie_weight * int(np.count_nonzero(self.cov <= low * 1.002))


def anneal(
    cluster: Cluster,
    start: Placement,
    config: SearchConfig | None = None,
    current: Placement | None = None,
) -> Placement:
    """Best placement found from `start` (which must be valid); always returns a valid placement."""
    config = config or SearchConfig()
    rng = random.Random(config.seed)
    ids = [n.id for n in cluster.nodes if cluster.layer_cap(n) > 0]
    if not ids:
        return dict(start)
    starts, counts = _Annealer(cluster, ids, start, config, current).run(rng)
    placement: Placement = {
        ids[i]: LayerRange(starts[i], starts[i] + counts[i]) for i in range(len(ids)) if counts[i] > 0
    }
    return repair(cluster, placement)


class _Annealer:
    """One annealing run: the state, how it is scored, and the Metropolis loop over random moves."""

    def __init__(
        self,
        cluster: Cluster,
        ids: list[NodeID],
        start: Placement,
        config: SearchConfig,
        current: Placement | None,
    ) -> None:
        self.cluster, self.config = cluster, config
        exact = config.exact_flow if config.exact_flow is not None else len(cluster.regions) > 1
        self.state = _State(cluster, ids, start)
        self.scorer = FlowScorer(cluster, ids) if exact else None
        self.old = [current.get(i) if current else None for i in ids]
        self.reload = config.reload_cost_tokens_s if current else 0.0
        self.tie_weight = config.tie_weight * upper_bound(cluster) / self.state.num_layers
        # "shortfall" anneals the summed shortfall below a target a little above the best minimum so far:
        # unlike the minimum itself it moves with every layer, so the annealer gets a slope, not plateaus.
        self.shortfall = config.objective == "shortfall" and self.scorer is None
        self.target = 0.0

    def new_layers(self, i: int) -> int:
        """Layers node i holds now but not in `current`."""
        state, old = self.state, self.old[i]
        count = state.counts[i]
        if old is None or count == 0:
            return count
        lo, hi = max(state.starts[i], old.start), min(state.starts[i] + count, old.end)
        return count - max(0, hi - lo)

    def penalty(self) -> float:
        return self.reload * sum(self.new_layers(i) for i in range(len(self.old))) if self.reload else 0.0

    def true_score(self, bound_only: bool = False) -> float:
        """The objective we report: coverage (or exact flow) minus the reload charge."""
        state, scorer = self.state, self.scorer
        cov = state.smooth_coverage(self.tie_weight) if scorer is None else state.coverage()
        if scorer is None or bound_only or cov == 0.0:
            return cov - self.penalty()
        return scorer.value(state.starts, state.counts) - self.penalty()

    def energy(self) -> float:
        """What the annealer climbs (higher is better)."""
        if self.shortfall:
            return -float(np.maximum(self.target - self.state.cov, 0.0).sum()) - self.penalty()
        return self.true_score()

    def retarget(self) -> None:
        self.target = max(self.target, self.state.coverage() * (1.0 + self.config.target_step))

    def try_move(
        self, rng: random.Random, changes: list[tuple[int, int, int]], score: float, temperature: float
    ) -> float | None:
        """Apply a move; keep it and return its energy if Metropolis accepts it, else undo it (None)."""
        state = self.state
        saved = [(i, state.starts[i], state.counts[i]) for i, _, _ in changes]
        for i, s, c in changes:
            state.set(i, s, c)
        threshold = score + temperature * math.log(1.0 - rng.random())
        # Only valid states (every layer held) are ever accepted, so the best state stays valid.
        if state.coverage() > 0.0 and (self.scorer is None or self.true_score(bound_only=True) >= threshold):
            new_score = self.energy()
            if new_score >= threshold:
                return new_score
        for i, s, c in reversed(saved):
            state.set(i, s, c)
        return None

    def run(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """The best (starts, counts) seen within the config's time and move budgets."""
        config, state = self.config, self.state
        scale = max(upper_bound(self.cluster), 1e-9)
        t_start, t_end = config.start_temperature * scale, config.end_temperature * scale
        self.retarget()
        current_score = self.energy()
        best_score, best = self.true_score(), (list(state.starts), list(state.counts))
        started = time.perf_counter()
        progress = 0.0
        n, num_layers = len(self.old), state.num_layers
        since_best = 0
        for it in range(config.max_iters):
            if it % 64 == 0:
                elapsed = time.perf_counter() - started
                if elapsed >= config.time_limit_s:
                    break
                progress = max(it / config.max_iters, elapsed / config.time_limit_s)
            temperature = t_start * (t_end / t_start) ** progress
            changes = _propose(rng, state, n, num_layers)
            if not changes:
                continue
            accepted = self.try_move(rng, changes, current_score, temperature)
            if accepted is not None:
                current_score = accepted
                value = self.true_score() if self.shortfall else current_score
                if value > best_score + 1e-9:
                    best_score, best = value, (list(state.starts), list(state.counts))
                    since_best = 0
                if self.shortfall and state.coverage() >= self.target:
                    self.retarget()
                    current_score = self.energy()
            since_best += 1
            if since_best > 20_000:
                # Stuck: go back to the best state seen (the annealer keeps its temperature schedule).
                for i in range(n):
                    state.set(i, best[0][i], best[1][i])
                current_score, since_best = self.energy(), 0
        return best


def _propose(rng: random.Random, state: _State, n: int, num_layers: int) -> list[tuple[int, int, int]]:
    """A random move as [(node index, new start, new count)]; empty when the draw changes nothing."""
    i = rng.randrange(n)
    s, c, cap = state.starts[i], state.counts[i], state.caps[i]
    move = rng.random()
    if move < 0.15 and c > 0:  # shift
        d = rng.choice((-1, 1)) * (1 + int(rng.expovariate(0.5)))
        ns = min(max(s + d, 0), num_layers - c)
        return [(i, ns, c)] if ns != s else []
    if move < 0.3:  # grow at either end
        if c >= cap:
            return []
        d = min(1 + int(rng.expovariate(0.7)), cap - c)
        if c == 0:
            ns = rng.randrange(num_layers)
            return [(i, min(ns, num_layers - d), d)]
        if rng.random() < 0.5 and s + c + d <= num_layers:
            return [(i, s, c + d)]
        ns = max(s - d, 0)
        return [(i, ns, c + (s - ns))] if ns != s else []
    if move < 0.45 and c > 0:  # shrink at either end (to idle at 0)
        d = min(1 + int(rng.expovariate(0.7)), c)
        if rng.random() < 0.5:
            return [(i, s, c - d)]
        return [(i, s + d, c - d) if c - d > 0 else (i, s, 0)]
    if move < 0.75 and c > 0:  # move a boundary shared with an abutting node: no hole, no double cover
        return _move_boundary(rng, state, i, n, num_layers)
    if move < 0.85:  # swap two nodes' ranges, clipped to each cap
        j = rng.randrange(n)
        if j == i:
            return []
        sj, cj = state.starts[j], state.counts[j]
        return [(i, sj, min(cj, cap)), (j, s, min(c, state.caps[j]))]
    # Cover the bottleneck: put this node on a range through the weakest layer.
    weakest = int(state.cov.argmin())
    count = rng.randint(1, cap)
    lo, hi = max(0, weakest - count + 1), min(weakest, num_layers - count)
    return [(i, rng.randint(lo, hi), count)]


def _move_boundary(
    rng: random.Random, state: _State, i: int, n: int, num_layers: int
) -> list[tuple[int, int, int]]:
    """Shift node i's start or end by a few layers; a node whose range abuts there gives or takes them."""
    s, c = state.starts[i], state.counts[i]
    d = rng.choice((-1, 1)) * (1 + int(rng.expovariate(0.7)))
    starts, counts, caps = state.starts, state.counts, state.caps
    if rng.random() < 0.5:
        edge, new_edge = s + c, s + c + d
        if not (s < new_edge <= num_layers and new_edge - s <= caps[i]):
            return []
        partners = [j for j in range(n) if counts[j] > 0 and starts[j] == edge and j != i]
        if not partners:
            return [(i, s, new_edge - s)]
        j = rng.choice(partners)
        end_j = starts[j] + counts[j]
        if not (new_edge < end_j and end_j - new_edge <= caps[j]):
            return []
        return [(i, s, new_edge - s), (j, new_edge, end_j - new_edge)]
    edge, new_edge = s, s + d
    if not (0 <= new_edge < s + c and s + c - new_edge <= caps[i]):
        return []
    partners = [j for j in range(n) if counts[j] > 0 and starts[j] + counts[j] == edge and j != i]
    if not partners:
        return [(i, new_edge, s + c - new_edge)]
    j = rng.choice(partners)
    if not (starts[j] < new_edge and new_edge - starts[j] <= caps[j]):
        return []
    return [(i, new_edge, s + c - new_edge), (j, starts[j], new_edge - starts[j])]
