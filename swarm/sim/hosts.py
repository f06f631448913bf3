"""Hosts: several processes (peers, the client) sharing a machine's cores, by processor sharing.

A volunteer may run two peers on one box, and our loopback testbed runs three peers and the client on two
cores. Alone, each process runs its work at full speed (one core: a peer's iteration, the client's LM head;
each is one Python process, so one core at most). When n processes of a host with K cores are busy at once,
each progresses at min(1, K / n) of full speed, times parallel_speed below. Work is in seconds alone.

In CLUSTER.json, nodes name their host and its cores: {"id": "a", ..., "host": "box1", "host_cores": 2}; the
simulated client joins a host with SimConfig.client_host. Nodes without "host" have a device of their own.

Optional "host_parallel_speed" (default 1): each process's speed, relative to running alone, while two or
more are busy. Cores are not all a machine shares: a decode step streams every weight it holds from memory
(and the client's LM head its whole vocabulary matrix), so processes on idle cores still slow each other
through memory bandwidth and caches. With n busy processes each runs at
    1 (n = 1),    parallel_speed * min(1, cores / n) (n >= 2).

The host keeps each busy process's remaining work; on every start or finish it advances them all by the time
passed at the old share and schedules one event for the soonest finish, tagged with a version so events made
stale by a later change are ignored. Hosts hold a handful of processes, so O(busy) per change is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from swarm.planner.cluster import Cluster

CLIENT = -3  # the process id of the simulated client on its host (nodes use their index)
DONE_EPS_S = 1e-12

Schedule = Callable[[float, "Host", int], None]  # (time, host, version): push a HOST_DONE event


class Host:
    """Cores shared by the busy processes on one machine."""

    __slots__ = ("name", "cores", "parallel_speed", "remaining", "last_t", "version", "busy_s")

    def __init__(self, name: str, cores: float, parallel_speed: float = 1.0) -> None:
        if not cores > 0:
            raise ValueError(f"host {name!r}: host_cores must be > 0, got {cores}")
        if not 0 < parallel_speed <= 1:
            raise ValueError(f"host {name!r}: host_parallel_speed must be in (0, 1], got {parallel_speed}")
        self.name = name
        self.cores = float(cores)
        self.parallel_speed = float(parallel_speed)
        self.remaining: dict[int, float] = {}  # busy process -> seconds of work left at full speed
        self.last_t = 0.0
        self.version = 0
        self.busy_s = 0.0  # core-seconds used (for utilisation)

    def share(self) -> float:
        """Speed of each busy process, as a fraction of one core."""
        n = len(self.remaining)
        return 1.0 if n <= 1 else self.parallel_speed * min(1.0, self.cores / n)

    def advance(self, now: float) -> None:
        dt = now - self.last_t
        if dt > 0 and self.remaining:
            done = dt * self.share()
            self.busy_s += done * len(self.remaining)
            for proc in self.remaining:
                self.remaining[proc] -= done
        self.last_t = now

    def start(self, now: float, proc: int, work_s: float, schedule: Schedule) -> None:
        if proc in self.remaining:
            raise RuntimeError(f"host {self.name}: process {proc} is already busy")
        self.advance(now)
        self.remaining[proc] = work_s
        self._reschedule(now, schedule)

    def cancel(self, now: float, proc: int, schedule: Schedule) -> None:
        """A process left (churn): its unfinished work is dropped."""
        if proc in self.remaining:
            self.advance(now)
            del self.remaining[proc]
            self._reschedule(now, schedule)

    def finish(self, now: float, version: int, schedule: Schedule) -> list[int]:
        """The processes whose work is done at this (non-stale) event; reschedules the rest."""
        if version != self.version:
            return []
        self.advance(now)
        done = [proc for proc, left in self.remaining.items() if left <= DONE_EPS_S]
        for proc in done:
            del self.remaining[proc]
        self._reschedule(now, schedule)
        return done

    def _reschedule(self, now: float, schedule: Schedule) -> None:
        self.version += 1
        if self.remaining:
            soonest = max(min(self.remaining.values()), 0.0)
            schedule(now + soonest / self.share(), self, self.version)


def hosts_of(cluster: Cluster, client_host: str | None) -> tuple[dict[str, Host], list[Host | None]]:
    """The hosts named by the cluster's nodes, and each node's host (None: a device of its own)."""
    cores: dict[str, float] = {}
    parallel: dict[str, float] = {}
    per_node: list[str | None] = []
    for node in cluster.nodes:
        name = node.extra.get("host")
        per_node.append(None if name is None else str(name))
        if name is None:
            continue
        for key, table, default in (("host_cores", cores, None), ("host_parallel_speed", parallel, 1.0)):
            value = _number(node.id, node.extra, key, default)
            if table.setdefault(str(name), value) != value:
                raise ValueError(f"host {name!r}: nodes disagree on {key} ({table[str(name)]} vs {value})")
    if client_host is not None and client_host not in cores:
        raise ValueError(f"client host {client_host!r} is not the host of any node")
    hosts = {name: Host(name, c, parallel[name]) for name, c in cores.items()}
    return hosts, [None if name is None else hosts[name] for name in per_node]


def _number(node_id: str, extra: dict[str, Any], key: str, default: float | None) -> float:
    if key not in extra:
        if default is None:
            raise ValueError(f"node {node_id}: 'host' needs '{key}'")
        return default
    try:
        return float(extra[key])
    except (TypeError, ValueError):
        raise ValueError(f"node {node_id}: {key} must be a number, got {extra[key]!r}") from None
