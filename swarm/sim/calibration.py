"""The simulator's side of scripts/calibrate.py: probed inputs -> CLUSTER.json fields -> predicted tokens/s.

scripts/calibrate.py runs a real 3-peer loopback swarm and probes it (CPU seconds per step, per forward, per
client token; how two peers slow each other); this module turns those probes into the node fields the
simulator reads (swarm/sim/timing.py, swarm/sim/hosts.py), simulates the same closed-loop workloads, and
lays the measured and simulated figures side by side. It does no I/O: everything live stays in the script.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from swarm.planner.cluster import Cluster
from swarm.planner.graph import max_flow
from swarm.sim.engine import SimConfig, Simulation
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import Request
from swarm.types import LayerRange, NodeID

TESTBED_HOST = "loopback"  # the peers and the client share this machine's cores (swarm/sim/hosts.py)
# max_batch_tokens = the peers' executor batch limit (swarm.peer.executor.ExecutorConfig.max_batch).
TESTBED_BATCH_TOKENS = 8


@dataclass
class Probed:
    """The simulator's inputs measured by the client: per peer CPU seconds of a one-stage decode step at
    batch 1 and 8, the extra CPU seconds per session-step it spends forwarding to the next peer, and the
    client's own CPU seconds per decode token."""

    step_cpu_s: dict[str, tuple[float, float]]
    step_wall_s: dict[str, tuple[float, float]]
    forward_s: dict[str, float]
    client_cpu_s: float
    route_cpu_s: float  # every process of the testbed, per decode token of one session
    parallel_speed: float  # a peer's one-stage step time alone / with another peer stepping at the same time

    @property
    def charged_cpu_s(self) -> float:
        """CPU per decode token of one session that the simulator charges (client, steps, forwards): to
        compare with route_cpu_s, which measured it whole."""
        steps = sum(b1 for b1, _ in self.step_cpu_s.values())
        return self.client_cpu_s + steps + sum(self.forward_s.values())


@dataclass
class Measured:
    """The probes (the simulator's inputs), then what it must predict."""

    probed: Probed
    rates: dict[int, list[float]] = field(default_factory=dict)  # concurrency -> tokens/s of each repeat
    cores: dict[int, float] = field(default_factory=dict)  # concurrency -> CPU cores the testbed used


def apply_probes(node: dict[str, Any], held_layers: int, probed: Probed, host_cores: int) -> None:
    """Set a CLUSTER.json node's timing from the probes: decode_s_per_layer from the CPU seconds its processes
    spent per one-stage step at batch 1 and 8, per held layer (what a real step costs on the peer:
    deserialising, the executor, the layers, p2pd relaying the request and the reply), its forward_s, and the
    host it shares with the other peers and the client."""
    b1_s, b8_s = (t / held_layers for t in probed.step_cpu_s[node["id"]])
    node["decode_s_per_layer"] = [[1, b1_s], [8, max(b8_s, b1_s)]]
    node["forward_s"] = probed.forward_s.get(node["id"], 0.0)
    node["host"], node["host_cores"] = TESTBED_HOST, host_cores
    node["host_parallel_speed"] = probed.parallel_speed


def without_hosts(cluster: Cluster) -> Cluster:
    """The cluster with every node on a device of its own (no "host"): the simulator's model before it knew
    about shared machines."""
    data = cluster.to_json()
    for node in data["nodes"]:
        for key in ("host", "host_cores", "host_parallel_speed"):
            node.pop(key, None)
    return Cluster.from_json(data)


def predict_tokens_s(
    cluster: Cluster,
    placement: dict[NodeID, LayerRange],
    c: int,
    p: int,
    n: int,
    client_cpu_s: float,
    shared_host: bool = True,
) -> float:
    """Aggregate decode tokens/s the simulator predicts for C sessions started at once (a closed loop of C),
    each of P prompt and N new tokens. shared_host=False drops the nodes' "host" (each peer with a core of
    its own, the client's time a delay), reported for comparison."""
    if not shared_host:
        cluster = without_hosts(cluster)
    plan = max_flow(cluster, placement, "measured")
    trace = [Request(i, 0.0, p, n) for i in range(c)]
    config = SimConfig(
        max_batch_tokens=TESTBED_BATCH_TOKENS,
        client_step_s=client_cpu_s,
        client_host=TESTBED_HOST if shared_host else None,
    )
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, config).run()
    if min(sim.requests.done_s) < 0:
        raise RuntimeError("the simulation did not finish every request")
    return sum(sim.requests.generated) / max(sim.requests.done_s)


def compare_run(
    measured: Measured,
    cluster: Cluster,
    announced: Cluster,
    placement: dict[NodeID, LayerRange],
    workload: tuple[int, int, int],
) -> dict[str, Any]:
    """One row of the report for workload (C, P, N): the measured median against the simulated tokens/s,
    and two simulated baselines (each peer on a core of its own; the peers' announced start-up tables)."""
    c = workload[0]
    client_cpu_s = measured.probed.client_cpu_s
    real = statistics.median(measured.rates[c])
    simulated = predict_tokens_s(cluster, placement, *workload, client_cpu_s)
    own_core = predict_tokens_s(cluster, placement, *workload, client_cpu_s, shared_host=False)
    with_announced = predict_tokens_s(announced, placement, *workload, client_cpu_s, shared_host=False)
    error = (simulated - real) / real
    return {
        "concurrency": c,
        "measured_decode_tokens_s": round(real, 2),
        "simulated_decode_tokens_s": round(simulated, 2),
        "error_fraction": round(error, 4),
        "within_15pct": abs(error) <= 0.15,
        "measured_repeats_tokens_s": [round(r, 2) for r in measured.rates[c]],
        "simulated_own_core_each_tokens_s": round(own_core, 2),
        "simulated_with_announced_tables_tokens_s": round(with_announced, 2),
        "swarm_cpu_cores_used": round(measured.cores[c], 2),
    }


def probe_report(probed: Probed, announced: dict[str, Any], chain: list[str]) -> dict[str, Any]:
    """The probes in the report, peers in route order, next to the decode tables the peers announced."""
    by_id = {node["id"]: node for node in announced["nodes"]}
    return {
        "probed_step_cpu_s_b1_b8": [[round(t, 5) for t in probed.step_cpu_s[p]] for p in chain],
        "probed_step_wall_s_b1_b8": [[round(t, 5) for t in probed.step_wall_s[p]] for p in chain],
        "probed_forward_cpu_s": [round(probed.forward_s.get(p, 0.0), 5) for p in chain],
        "announced_decode_s_per_layer_b1_b8": [
            [round(t, 5) for _, t in by_id[p]["decode_s_per_layer"]] for p in chain
        ],
        "client_cpu_s_per_token": round(probed.client_cpu_s, 5),
        "route_cpu_s_per_token": round(probed.route_cpu_s, 5),
        "charged_cpu_s_per_token": round(probed.charged_cpu_s, 5),
        "host_parallel_speed": round(probed.parallel_speed, 4),
    }
