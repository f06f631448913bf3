"""Shared hosts: processor sharing of a machine's cores, parallel speed, and the engine on a shared host."""

from __future__ import annotations

import pytest

from swarm.planner.cluster import Cluster, ClusterNode, ModelInfo, full_mesh_links
from swarm.planner.graph import max_flow
from swarm.sim.engine import SimConfig, Simulation
from swarm.sim.hosts import CLIENT, Host, hosts_of
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import Request
from swarm.types import LayerRange, NodeID

pytestmark = pytest.mark.timeout(60)


class Clock:
    """Collects the host's scheduled completions, as the engine's heap would."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []

    def __call__(self, t: float, host: Host, version: int) -> None:
        self.events.append((t, version))

    def run(self, host: Host) -> dict[int, float]:
        """Fire events in time order until the host is idle; returns each process's finish time."""
        done: dict[int, float] = {}
        while self.events:
            self.events.sort()
            t, version = self.events.pop(0)
            for proc in host.finish(t, version, self):
                done[proc] = t
        return done


def test_alone_full_speed_then_shared_cores() -> None:
    host, clock = Host("h", cores=1), Clock()
    host.start(0.0, 0, 1.0, clock)
    assert clock.run(host) == {0: pytest.approx(1.0)}
    # Two processes on one core: each at half speed; the shorter finishes at 2 x 0.5, the other then runs alone.
    host, clock = Host("h", cores=1), Clock()
    host.start(0.0, 0, 0.5, clock)
    host.start(0.0, 1, 1.0, clock)
    assert clock.run(host) == {0: pytest.approx(1.0), 1: pytest.approx(1.5)}
    assert host.busy_s == pytest.approx(1.5)


def test_two_cores_and_parallel_speed() -> None:
    host, clock = Host("h", cores=2), Clock()
    host.start(0.0, 0, 1.0, clock)
    host.start(0.0, 1, 1.0, clock)
    assert clock.run(host) == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}
    # Memory bandwidth: two at once each run at 0.8 even with a core each; three share two cores as well.
    host, clock = Host("h", cores=2, parallel_speed=0.8), Clock()
    for proc in range(3):
        host.start(0.0, proc, 1.0, clock)
    finish = 1.0 / (0.8 * 2 / 3)
    assert clock.run(host) == {p: pytest.approx(finish) for p in range(3)}


def test_late_start_and_cancel_reschedule() -> None:
    host, clock = Host("h", cores=1), Clock()
    host.start(0.0, 0, 1.0, clock)
    host.start(0.5, CLIENT, 0.25, clock)  # from 0.5 both at half speed: the client's 0.25 takes 0.5
    host.cancel(0.6, 7, clock)  # not busy: nothing changes
    done = clock.run(host)
    assert done[CLIENT] == pytest.approx(1.0)
    assert done[0] == pytest.approx(1.25)  # 0.5 done alone, 0.25 shared by 1.0, the last 0.25 alone
    host, clock = Host("h", cores=1), Clock()
    host.start(0.0, 0, 1.0, clock)
    host.start(0.0, 1, 1.0, clock)
    host.cancel(0.5, 1, clock)
    assert clock.run(host) == {0: pytest.approx(1.25)}


def test_bad_hosts_are_rejected() -> None:
    with pytest.raises(ValueError):
        Host("h", cores=0)
    with pytest.raises(ValueError):
        Host("h", cores=2, parallel_speed=1.5)
    with pytest.raises(RuntimeError):
        host, clock = Host("h", cores=1), Clock()
        host.start(0.0, 0, 1.0, clock)
        host.start(0.0, 0, 1.0, clock)
    model = ModelInfo("m", 2, 1024, 4)
    a = ClusterNode(NodeID("a"), "r0", 2, (100.0, 50.0), {"host": "h"})
    with pytest.raises(ValueError, match="host_cores"):
        hosts_of(Cluster(model, (a,), ()), None)
    b = ClusterNode(NodeID("b"), "r0", 2, (100.0, 50.0), {"host": "h", "host_cores": 2})
    c = ClusterNode(NodeID("c"), "r0", 2, (100.0, 50.0), {"host": "h", "host_cores": 4})
    with pytest.raises(ValueError, match="disagree"):
        hosts_of(Cluster(model, (b, c), ()), None)
    with pytest.raises(ValueError, match="client host"):
        hosts_of(Cluster(model, (b,), ()), "elsewhere")


def chain_cluster(host: dict[str, object] | None) -> Cluster:
    """Three nodes of one layer each, every decode step 10 ms alone (measured-table style)."""
    model = ModelInfo("m", 3, 1024, 4)
    table = {"decode_s_per_layer": [[1, 0.01], [8, 0.01]], "prefill_s_per_layer": [[10, 0.01]]}
    nodes = tuple(
        ClusterNode(NodeID(n), "r0", 1, (100.0,), {**table, **(host or {})}) for n in ("a", "b", "c")
    )
    return Cluster(model, nodes, full_mesh_links(nodes, bandwidth_bytes_s=1e9, latency_s=0.0))


def closed_loop_rate(cluster: Cluster, sessions: int, client_host: str | None) -> float:
    placement = {NodeID(n): LayerRange(i, i + 1) for i, n in enumerate("abc")}
    plan = max_flow(cluster, placement, "hand")
    trace = [Request(i, 0.0, 10, 50) for i in range(sessions)]
    config = SimConfig(client_step_s=0.01, client_host=client_host, max_batch_tokens=1)
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, config).run()
    assert min(sim.requests.done_s) > 0
    return sum(sim.requests.generated) / max(sim.requests.done_s)


def test_shared_host_caps_a_closed_loop_at_its_cores() -> None:
    # Four processes (3 nodes + the client), 10 ms of work each per token: 40 ms of work a token.
    own = closed_loop_rate(chain_cluster(None), 4, None)
    one_core = closed_loop_rate(chain_cluster({"host": "h", "host_cores": 1}), 4, "h")
    two_cores = closed_loop_rate(chain_cluster({"host": "h", "host_cores": 2}), 4, "h")
    slower = closed_loop_rate(
        chain_cluster({"host": "h", "host_cores": 2, "host_parallel_speed": 0.5}), 4, "h"
    )
    assert own > 2 * one_core
    assert one_core == pytest.approx(25.0, rel=0.05)  # 1 core / 40 ms
    assert two_cores == pytest.approx(50.0, rel=0.05)
    assert slower == pytest.approx(25.0, rel=0.05)
    # One session alone never shares: the same on any host.
    alone = closed_loop_rate(chain_cluster({"host": "h", "host_cores": 1}), 1, "h")
    assert alone == pytest.approx(closed_loop_rate(chain_cluster(None), 1, None), rel=0.01)
