"""Peers joining and leaving on a schedule, with re-planning as the live planner does it.

SCHEDULE.json: {"events": [{"time_s": 60, "leave": "a100-1"}, {"time_s": 120, "join": "t4-3"}, ...]}
Every node named must be in CLUSTER.json; a node whose first event is a join starts outside the swarm.

On each event the planner re-solves on the nodes present, warm-started from the live placement
(swarm.planner.solve(..., current=...)). Nodes whose layers change reload for `reload_s_per_layer` per
layer; they keep serving their old layers meanwhile (make before break), and their sessions fail over
when they switch. A leaving node's sessions fail over at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swarm.planner.cluster import Cluster
from swarm.sim.engine import Simulation
from swarm.types import LayerRange, NodeID, Plan

logger = logging.getLogger(__name__)

Planner = Callable[[Cluster, dict[NodeID, LayerRange] | None], Plan]


@dataclass(frozen=True)
class ChurnEvent:
    time_s: float
    node: NodeID
    joins: bool  # True: the node joins; False: it leaves


def load_schedule(path: str | Path, cluster: Cluster) -> list[ChurnEvent]:
    with open(path) as f:
        data = json.load(f)
    events: list[ChurnEvent] = []
    for i, item in enumerate(data.get("events", []) if isinstance(data, dict) else []):
        if not isinstance(item, dict) or "time_s" not in item or ("join" in item) == ("leave" in item):
            raise ValueError(f"{path}: event {i} needs time_s and exactly one of join / leave")
        node = NodeID(str(item.get("join", item.get("leave"))))
        if node not in cluster.node_by_id:
            raise ValueError(f"{path}: event {i} names node {node!r}, which is not in the cluster")
        events.append(ChurnEvent(float(item["time_s"]), node, "join" in item))
    return sorted(events, key=lambda e: e.time_s)


def initially_absent(events: list[ChurnEvent]) -> set[NodeID]:
    """Nodes whose first event is a join."""
    first: dict[NodeID, bool] = {}
    for e in events:
        first.setdefault(e.node, e.joins)
    return {n for n, joins in first.items() if joins}


def present_cluster(cluster: Cluster, present: set[NodeID]) -> Cluster:
    nodes = tuple(n for n in cluster.nodes if n.id in present)
    links = tuple(lk for lk in cluster.links if lk.src not in cluster.node_by_id or lk.src in present)
    links = tuple(lk for lk in links if lk.dst not in cluster.node_by_id or lk.dst in present)
    return Cluster(cluster.model, nodes, links)


class Churn:
    """Drives a Simulation through a schedule; `replan(cluster, current)` is the planner call."""

    def __init__(
        self,
        sim: Simulation,
        events: list[ChurnEvent],
        replan: Planner,
        present: set[NodeID],
        reload_s_per_layer: float,
    ) -> None:
        self.sim = sim
        self.replan = replan
        self.present = set(present)
        self.reload_s_per_layer = reload_s_per_layer
        self.replans = 0
        for e in events:
            sim.at(e.time_s, lambda e=e: self.apply(e))  # type: ignore[misc]

    def apply(self, event: ChurnEvent) -> None:
        sim = self.sim
        i = sim.index[event.node]
        if event.joins:
            self.present.add(event.node)
        else:
            self.present.discard(event.node)
            for r in sim.remove(i):
                sim.fail_over(r, i)
        current = {n: r for n, r in sim.plan.placement.items() if n in self.present}
        try:
            plan = self.replan(present_cluster(sim.cluster, self.present), current)
        except Exception as e:  # noqa: BLE001 - a failed re-plan keeps the old plan, as the live planner does
            logger.warning("re-plan at %.0f s failed (%s): keeping the old plan", sim.now, e)
            return
        self.replans += 1
        sim.set_plan(plan)
        sim.try_admit()
        for node_id, layers in plan.placement.items():
            j = sim.index[node_id]
            if sim.nodes[j].alive and sim.nodes[j].layers == layers:
                continue
            # Make before break: the node keeps serving its old layers while it loads the new ones.
            ready_s = sim.now + self.reload_s_per_layer * len(layers)
            sim.at(ready_s, lambda j=j, node_id=node_id, layers=layers: self._ready(j, node_id, layers))  # type: ignore[misc]
        logger.info(
            "t=%.0f s: %s %s; plan %.0f tokens/s",
            sim.now,
            event.node,
            "joined" if event.joins else "left",
            plan.max_flow_tokens_s,
        )

    def _ready(self, j: int, node_id: NodeID, layers: LayerRange) -> None:
        sim = self.sim
        # A later re-plan or a departure may have changed our mind while the layers loaded.
        if node_id not in self.present or sim.plan.placement.get(node_id) != layers:
            return
        if sim.nodes[j].alive and sim.nodes[j].layers == layers:
            return
        lost = sim.remove(j) if sim.nodes[j].alive else []
        sim.set_layers(j, layers)
        for r in lost:  # sessions on the old layers move on, possibly to this node's new ones
            sim.fail_over(r, j)
        sim.try_admit()
