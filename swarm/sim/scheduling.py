"""The scheduling policies compared by the simulator, all built on swarm.routing.Router.

* iwrr: the live client's policy: IWRR over the plan's edge flows.
* random: uniform over the valid next hops of the placement (any edge the placement makes valid).
* swarm: SWARM parallelism's stochastic wiring: a valid next hop drawn in proportion to its throughput.

random and swarm draw each hop with a SampledRouter: the live Router's candidates, masking and look-ahead,
with a weighted random draw in place of the IWRR's turn. Only the simulator needs it, so it lives here.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import replace

from swarm.planner.cluster import Cluster
from swarm.planner.graph import valid_edges
from swarm.routing import IWRR, Router
from swarm.sim.view import RouterFactory
from swarm.types import SINK, EdgeFlow, NodeID, Plan


class SampledRouter(Router):
    """Draws each hop at random among the unmasked candidates, with probability proportional to the plan's
    weights on them, instead of taking the IWRR's turn."""

    def __init__(self, plan: Plan, rng: random.Random) -> None:
        super().__init__(plan)
        self.draws = rng  # (not Router.rng: that one would also move the IWRR phases)
        self._cum_weights: dict[int, list[float]] = {}  # by id() of the IWRR, which lives as long as we do

    def _choose(self, iwrr: IWRR[NodeID], masked: Callable[[NodeID], bool]) -> NodeID | None:
        # Rejection sampling: a few draws over all candidates are cheap when most are usable; when they keep
        # hitting masked ones, draw among the usable ones only.
        for _ in range(4):
            cum = self._cum_weights.get(id(iwrr))
            if cum is None:
                cum = self._cum_weights[id(iwrr)] = list(itertools.accumulate(iwrr.weights))
            v = self.draws.choices(iwrr.candidates, cum_weights=cum)[0]
            if not masked(v):
                return v
        pairs = [(v, w) for v, w in zip(iwrr.candidates, iwrr.weights, strict=True) if not masked(v)]
        if not pairs:
            return None
        return self.draws.choices([v for v, _ in pairs], [w for _, w in pairs])[0]


def weighted_plan(cluster: Cluster, plan: Plan, weight: Callable[[NodeID], float]) -> Plan:
    """The plan with a flow on EVERY valid edge of its placement, weighted by weight(dst): baseline routing."""
    flows = tuple(EdgeFlow(u, v, weight(v)) for u, v, _ in valid_edges(cluster, plan.placement) if v != SINK)
    return replace(plan, flows=flows)


def router_factory(cluster: Cluster, scheduling: str, seed: int) -> RouterFactory:
    """iwrr: the plan's flows, smooth. random: uniform over valid next hops. swarm: by next hop's tokens/s."""
    if scheduling == "iwrr":
        return lambda plan: Router(plan)
    if scheduling == "random":
        return lambda plan: SampledRouter(weighted_plan(cluster, plan, lambda v: 1.0), random.Random(seed))
    if scheduling == "swarm":

        def make(plan: Plan) -> Router:
            def speed(v: NodeID) -> float:
                return max(cluster.node_by_id[v].tokens_s(len(plan.placement[v])), 1e-9)

            return SampledRouter(weighted_plan(cluster, plan, speed), random.Random(seed))

        return make
    raise ValueError(f"unknown scheduling {scheduling!r}: choose from iwrr, random, swarm")
