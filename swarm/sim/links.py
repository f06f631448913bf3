"""Links of the simulation: each directed link is a FIFO pipe.

A message waits for the previous one to finish sending, takes bytes / bandwidth to send, then arrives
`latency_s` later (a decode message of K quantum tokens stands for K steps: K x latency). Links are created
on first use from CLUSTER.json, or from SimConfig's missing-link figures where the cluster has none.
"""

from __future__ import annotations

from swarm.planner.cluster import Cluster
from swarm.sim.config import SimConfig
from swarm.sim.events import EventQueue
from swarm.sim.records import (
    CLIENT_DECODE,
    CLIENT_PREFILL,
    DELIVER_DECODE,
    DELIVER_PREFILL,
    SNK,
    SRC,
    Link,
    Node,
)
from swarm.types import SINK, SOURCE


class Network:
    """The links between nodes and the client; `send` queues a message and schedules its delivery."""

    def __init__(self, cluster: Cluster, nodes: list[Node], config: SimConfig, events: EventQueue) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.config = config
        self.events = events
        self.quantum = config.decode_quantum_tokens
        # Keyed by one int, (src + 2) * stride + dst + 2, not a (src, dst) tuple: the hot path looks up a link
        # per message.
        self.links: dict[int, Link] = {}
        self._stride = len(nodes) + 2
        self._push = events.push  # bound once: called per message

    def _new_link(self, src: int, dst: int) -> Link:
        a = SOURCE if src == SRC else self.nodes[src].id
        b = SINK if dst == SNK else self.nodes[dst].id
        spec = self.cluster.link_by_pair.get((a, b))
        if spec is None or spec.bandwidth_bytes_s <= 0:
            bandwidth, latency = (
                self.config.missing_link_bandwidth_bytes_s,
                self.config.missing_link_latency_s,
            )
        else:
            bandwidth, latency = spec.bandwidth_bytes_s, spec.latency_s
        link = self.links[(src + 2) * self._stride + dst + 2] = Link(src, dst, bandwidth, latency)
        return link

    def transfer(self, src: int, dst: int, nbytes: int) -> float:
        """Queue a bulk transfer (a KV cache) on the link src -> dst; returns when it has arrived."""
        now = self.events.now
        link = self.links.get((src + 2) * self._stride + dst + 2) or self._new_link(src, dst)
        start = max(link.free_at, now)
        link.wait_s += start - now
        link.messages += 1
        link.free_at = start + nbytes / link.bandwidth_bytes_s
        return link.free_at + link.latency_s

    def send(
        self, src: int, dst: int, nbytes: int, payload: list, prefill: bool, delay_s: float = 0.0
    ) -> None:  # type: ignore[type-arg]
        """Put a message on the link src -> dst, `delay_s` from now, and schedule its delivery."""
        link = self.links.get((src + 2) * self._stride + dst + 2)
        if link is None:
            link = self._new_link(src, dst)
        now = self.events.now + delay_s
        start = link.free_at if link.free_at > now else now
        link.wait_s += start - now
        link.messages += 1
        link.free_at = start + nbytes / link.bandwidth_bytes_s
        arrive = link.free_at + (link.latency_s if prefill else link.latency_s * self.quantum)
        if dst == SNK:
            self._push(arrive, CLIENT_PREFILL if prefill else CLIENT_DECODE, 0, payload)
        else:
            inc = self.nodes[dst].incarnation
            self._push(arrive, DELIVER_PREFILL if prefill else DELIVER_DECODE, dst, (inc, payload))
