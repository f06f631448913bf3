"""The scheduling policies compared by the simulator, all built on swarm.routing.Router.

* iwrr: the live client's policy: IWRR over the plan's edge flows.
* random: uniform over the valid next hops of the placement (any edge the placement makes valid).
* swarm: SWARM parallelism's stochastic wiring: a valid next hop drawn in proportion to its throughput.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from swarm.planner.cluster import Cluster
from swarm.planner.graph import valid_edges
from swarm.routing import Router
from swarm.types import SINK, EdgeFlow, NodeID, Plan

RouterFactory = Callable[[Plan], Router]


def weighted_plan(cluster: Cluster, plan: Plan, weight: Callable[[NodeID], float]) -> Plan:
    """The plan with a flow on EVERY valid edge of its placement, weighted by weight(dst): baseline routing."""
    flows = tuple(EdgeFlow(u, v, weight(v)) for u, v, _ in valid_edges(cluster, plan.placement) if v != SINK)
    return replace(plan, flows=flows)


def router_factory(cluster: Cluster, scheduling: str, seed: int) -> RouterFactory:
    """iwrr: the plan's flows, smooth. random: uniform over valid next hops. swarm: by next hop's tokens/s."""
    if scheduling == "iwrr":
        return lambda plan: Router(plan)
    if scheduling == "random":
        return lambda plan: Router(weighted_plan(cluster, plan, lambda v: 1.0), rng=random.Random(seed))
    if scheduling == "swarm":

        def make(plan: Plan) -> Router:
            def speed(v: NodeID) -> float:
                return max(cluster.node_by_id[v].tokens_s(len(plan.placement[v])), 1e-9)

            return Router(weighted_plan(cluster, plan, speed), rng=random.Random(seed))

        return make
    raise ValueError(f"unknown scheduling {scheduling!r}: choose from iwrr, random, swarm")
