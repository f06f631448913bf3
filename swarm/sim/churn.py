"""Peers joining and leaving on a schedule, with re-planning as the live planner does it.

SCHEDULE.json: {"events": [{"time_s": 60, "leave": "a100-1"}, {"time_s": 120, "join": "t4-3"}, ...]}
Every node named must be in CLUSTER.json; a node whose first event is a join starts outside the swarm.

SCHEDULE.json events may carry "kill": true: the node dies at once (no hand-over); otherwise it leaves
gracefully (SIGTERM).

On each event the planner re-plans on the nodes present (experiment.churn_planner). A node told to move:
* with SimConfig.make_before_break (the swarm of issue 13): loads only the layers it lacks, for
  `reload_s_per_layer` each, while it keeps serving. A node whose new range contains its old one then
  simply grows and keeps its sessions. Otherwise, where both ranges fit its memory (max_layers), it announces
  the new range (new sessions only there) and keeps serving its old sessions until they end, then drops the
  old range. Where they do not fit, it hands its sessions over (KV streamed to a successor, or a partial
  replay; swarm/sim/moves.py) and is out while it loads. Simplifications: "fits" counts layers against
  max_layers only (not the KV cache the old sessions still use), and while it drains, every iteration of
  the node is timed as if it held the new range alone.
* without it (before issue 13): it keeps serving its old layers while loading all of the new range, then
  switches and all its sessions fail over.
A graceful leave hands sessions over (SimConfig.kv_handover), else they fail over.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    kill: bool = False  # a leave without warning: no KV hand-over


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
        events.append(ChurnEvent(float(item["time_s"]), node, "join" in item, bool(item.get("kill", False))))
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
        self.log: list[dict[str, Any]] = []  # per event: what it did (see counters())
        for e in events:
            sim.at(e.time_s, lambda e=e: self.apply(e))  # type: ignore[misc]

    def counters(self) -> dict[str, int]:
        sim = self.sim
        return {
            "failovers": sim.counters.failovers,
            "handovers": sim.counters.handovers,
            "restarts": sim.counters.restarts,
            "replayed_tokens": sim.counters.replayed_tokens,
        }

    def events(self) -> list[dict[str, Any]]:
        """Per event: time, node, sessions on the leaving node, nodes moved, and the counters' growth until
        the next event (failovers, hand-overs, restarts, replayed tokens)."""
        out = []
        ends = [e["counters"] for e in self.log[1:]] + [self.counters()]
        for e, end in zip(self.log, ends, strict=True):
            start = e["counters"]
            row = {k: v for k, v in e.items() if k != "counters"}
            row |= {k: end[k] - start[k] for k in end}
            out.append(row)
        return out

    def apply(self, event: ChurnEvent) -> None:
        sim = self.sim
        i = sim.index[event.node]
        entry: dict[str, Any] = {
            "time_s": sim.now,
            "node": str(event.node),
            "event": "join" if event.joins else "kill" if event.kill else "leave",
            "counters": self.counters(),
            "sessions_on_node": 0 if event.joins else len(sim.nodes[i].sessions),
        }
        self.log.append(entry)
        if event.joins:
            self.present.add(event.node)
        else:
            self.present.discard(event.node)
            lost = sim.remove(i)
            if event.kill:
                for r in lost:
                    sim.fail_over(r, i)
            else:
                sim.give_up(i, lost)
        current = {n: r for n, r in sim.plan.placement.items() if n in self.present}
        try:
            plan = self.replan(present_cluster(sim.cluster, self.present), current)
        except Exception as e:  # noqa: BLE001 - a failed re-plan keeps the old plan, as the live planner does
            logger.warning("re-plan at %.0f s failed (%s): keeping the old plan", sim.now, e)
            return
        self.replans += 1
        sim.set_plan(plan)
        sim.try_admit()
        moved = 0
        for node_id, layers in plan.placement.items():
            j = sim.index[node_id]
            if sim.nodes[j].alive and sim.nodes[j].layers == layers:
                continue
            moved += sim.nodes[j].alive
            self._order(j, node_id, layers)
        entry["nodes_moved"] = moved
        logger.info(
            "t=%.0f s: %s %s; plan %.0f tokens/s, %d nodes moved",
            sim.now,
            event.node,
            "joined" if event.joins else "left",
            plan.max_flow_tokens_s,
            moved,
        )

    def _order(self, j: int, node_id: NodeID, layers: LayerRange) -> None:
        """Node j is told to hold `layers`: schedule its move (see the module's docstring)."""
        sim, node = self.sim, self.sim.nodes[j]
        old = node.layers
        if not sim.config.make_before_break or not node.alive or old is None:
            ready_s = sim.now + self.reload_s_per_layer * len(layers)
            sim.at(ready_s, lambda: self._ready(j, node_id, layers))
            return
        held = set(range(old.start, old.end))
        if node.old_layers is not None:
            held |= set(range(node.old_layers.start, node.old_layers.end))
        new = set(range(layers.start, layers.end))
        load_s = self.reload_s_per_layer * len(new - held)
        if layers.covers(old) or len(held | new) <= sim.cluster.layer_cap(sim.cluster.node_by_id[node_id]):
            sim.at(sim.now + load_s, lambda: self._switch(j, node_id, layers))
            return
        # Both ranges do not fit: its sessions move now, then it loads the layers it lacks.
        sim.give_up(j, sim.remove(j))
        sim.at(sim.now + load_s, lambda: self._ready(j, node_id, layers))

    def _wanted(self, node_id: NodeID, layers: LayerRange) -> bool:
        # A later re-plan or a departure may have changed our mind while the layers loaded.
        return node_id in self.present and self.sim.plan.placement.get(node_id) == layers

    def _switch(self, j: int, node_id: NodeID, layers: LayerRange) -> None:
        """Make before break: the new range is loaded; new sessions go there, old ones drain."""
        sim, node = self.sim, self.sim.nodes[j]
        if not self._wanted(node_id, layers) or not node.alive or node.layers == layers:
            return
        assert node.layers is not None
        if not layers.covers(node.layers):
            if node.old_layers is not None:  # a third range: the oldest sessions move on now
                sim.give_up(j, sorted(node.draining))
            node.old_layers, node.draining = node.layers, set(node.sessions)
        sim.relayer(j, layers)
        sim.try_admit()

    def _ready(self, j: int, node_id: NodeID, layers: LayerRange) -> None:
        sim = self.sim
        if not self._wanted(node_id, layers):
            return
        if sim.nodes[j].alive and sim.nodes[j].layers == layers:
            return
        lost = sim.remove(j) if sim.nodes[j].alive else []
        sim.set_layers(j, layers)
        # Sessions on the old layers move on (possibly to this node's new ones).
        sim.give_up(j, lost)
        sim.try_admit()
