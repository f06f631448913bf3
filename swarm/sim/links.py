"""Links of the simulation: each directed link is a FIFO pipe.

A message waits for the previous one to finish sending, takes bytes / bandwidth to send, then arrives
`latency_s` later (a decode message of K quantum tokens stands for K steps: K x latency). Links are created
on first use from CLUSTER.json, or from SimConfig's missing-link figures where the cluster has none.
"""

from __future__ import annotations

from heapq import heappush
from typing import TYPE_CHECKING

from swarm.sim.records import CLIENT_DECODE, CLIENT_PREFILL, DELIVER_DECODE, DELIVER_PREFILL, SNK, SRC, Link
from swarm.types import SINK, SOURCE

if TYPE_CHECKING:
    from swarm.sim.engine import Simulation


def new_link(sim: Simulation, src: int, dst: int) -> Link:
    a = SOURCE if src == SRC else sim.ids[src]
    b = SINK if dst == SNK else sim.ids[dst]
    spec = sim.cluster.link_by_pair.get((a, b))
    if spec is None or spec.bandwidth_bytes_s <= 0:
        bandwidth, latency = (
            sim.config.missing_link_bandwidth_bytes_s,
            sim.config.missing_link_latency_s,
        )
    else:
        bandwidth, latency = spec.bandwidth_bytes_s, spec.latency_s
    link = sim.links[(src + 2) * sim._link_stride + dst + 2] = Link(src, dst, bandwidth, latency)
    return link


def transfer(sim: Simulation, src: int, dst: int, nbytes: int) -> float:
    """Queue a bulk transfer (a KV cache) on the link src -> dst; returns when it has arrived."""
    link = sim.links.get((src + 2) * sim._link_stride + dst + 2) or new_link(sim, src, dst)
    start = max(link.free_at, sim.now)
    link.wait_s += start - sim.now
    link.messages += 1
    link.free_at = start + nbytes / link.bandwidth_bytes_s
    return link.free_at + link.latency_s


def send(
    sim: Simulation, src: int, dst: int, nbytes: int, payload: list, prefill: bool, delay_s: float = 0.0
) -> None:  # type: ignore[type-arg]
    """Put a message on the link src -> dst, `delay_s` from now, and schedule its delivery."""
    link = sim.links.get((src + 2) * sim._link_stride + dst + 2)
    if link is None:
        link = new_link(sim, src, dst)
    now = sim.now + delay_s
    start = link.free_at if link.free_at > now else now
    link.wait_s += start - now
    link.messages += 1
    link.free_at = start + nbytes / link.bandwidth_bytes_s
    arrive = link.free_at + (link.latency_s if prefill else link.latency_s * sim.quantum)
    sim._seq += 1
    event: tuple[float, int, int, int, object]
    if dst == SNK:
        event = (arrive, sim._seq, CLIENT_PREFILL if prefill else CLIENT_DECODE, 0, payload)
    else:
        inc = sim.nodes[dst].incarnation
        event = (arrive, sim._seq, DELIVER_PREFILL if prefill else DELIVER_DECODE, dst, (inc, payload))
    heappush(sim._heap, event)
