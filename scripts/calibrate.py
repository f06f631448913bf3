#!/usr/bin/env python
"""Calibrate the simulator against a real 3-peer loopback swarm. Prints ONE JSON object.

1. Starts three `swarm-peer join --no-follow-plan` processes on 127.0.0.1 with fixed ranges (0:10/10:20/20:30
   for the default model, 0:2/2:4/4:6 for tiny) and waits until their records carry measured numbers.
2. Builds CLUSTER.json (written to --out-dir) from what was measured, and nothing else:
   * nodes: swarm.peer.planner_service.cluster_from_snapshot (tokens_s_by_layers from decode at batch 8),
     prefill_s_per_layer from the record's measured prefill rate, cache_tokens, and decode_s_per_layer at
     batch 1 and 8 from client-side probes of each peer alone (one-stage routes, 1 and 8 concurrent sessions,
     median of 20 steps, less the probe RTT, per held layer): this includes the per-step RPC/executor cost on
     the peer, and is taken just before the workload, where the peers' own start-up figures (8 steps, once,
     while loading) are noisy on a shared machine. The simulation with the announced tables is reported too;
   * links between peers: the peers' own probes (latency = RTT / 2);
   * client links: probed from this process the same way (swarm.transport.measure_link). A step is a nested
     RPC (client -> A -> B -> C, the reply comes back C -> B -> A -> client), so the simulator's last-stage ->
     sink link carries the reply path: the sum of the one-way latencies of the hops the reply retraces.
   The client's own per-token time (embedding + LM head + argmax) is measured here and passed to the simulator
   as SimConfig.client_step_s. "swarm_cpu_cores_used" (CPU seconds of the peers' and this process group /
   wall seconds during the workload) shows when the loopback testbed is CPU-bound: the simulator gives every
   node its own device, so on a 2-core machine it over-predicts once the peers and client saturate the cores.
3. Measures end to end: C concurrent greedy sessions (AsyncSwarmClient, P prompt tokens, N new tokens, EOS
   ignored); aggregate decode tokens/s = all generated tokens / time from start to the last session's end.
4. Simulates the same workload (same placement = the real ranges, C requests all at t=0 = closed loop with C
   sessions, same lengths) with scripts/sim unchanged, and computes the same figure.

    .venv/bin/python scripts/calibrate.py                        # default model (SmolLM2-135M)
    .venv/bin/python scripts/calibrate.py --model tiny --concurrency 2 --prompt-tokens 8 --new-tokens 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from sim.engine import SimConfig, Simulation  # noqa: E402
from sim.scheduling import router_factory  # noqa: E402
from sim.trace import Request  # noqa: E402

from client import AsyncSwarmClient  # noqa: E402
from swarm.dht import SwarmSnapshot  # noqa: E402
from swarm.peer.planner_service import PlannerConfig, cluster_from_snapshot  # noqa: E402
from swarm.planner import Cluster, max_flow  # noqa: E402
from swarm.routing.route import Stage  # noqa: E402
from swarm.transport.calls import measure_link  # noqa: E402
from swarm.types import SINK, SOURCE, LayerRange, NodeID, SessionID  # noqa: E402
from tests.helpers.swarm import LocalSwarm, swarm_client  # noqa: E402

DEFAULT_RANGES = {"default": ("0:10", "10:20", "20:30"), "tiny": ("0:2", "2:4", "4:6")}
MEASURE_PREFILL_TOKENS = 128  # swarm.peer.measure.measure_compute's prefill length


def prompt_ids(vocab_size: int, n: int, salt: int) -> list[int]:
    return [(7 * i + 3 + 101 * salt) % vocab_size for i in range(n)]


async def wait_measured(
    initial_peers: list[str], model_hash: str, peer_ids: list[str], timeout_s: float
) -> tuple[SwarmSnapshot, dict[str, tuple[float, float]]]:
    """The first snapshot where every peer is serving with measured speeds and probed links to the others,
    and this client's own (rtt_s, bandwidth_bytes_s) to each peer."""
    async with swarm_client(initial_peers, model_hash) as (_dht, directory, p2p):
        deadline = time.monotonic() + timeout_s
        while True:
            snap = await directory.snapshot()
            recs = [snap.peers.get(p) for p in peer_ids]
            ready = all(
                r is not None
                and r.state == "serving"
                and r.decode_layer_tokens_s_b1 > 0
                and r.decode_layer_tokens_s_b8 > 0
                and all(o in r.links or r.peer_id in snap.peers[o].links for o in peer_ids if o != r.peer_id)
                for r in recs
            )
            if ready:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"peers not measured after {timeout_s:.0f} s: {[r is not None for r in recs]}"
                )
            await asyncio.sleep(1.0)
        client_links = {}
        for pid in peer_ids:
            client_links[pid] = await measure_link(p2p, pid, maddrs=tuple(snap.peers[pid].maddrs))
        return snap, client_links


def build_cluster(
    snap: SwarmSnapshot,
    client_links: dict[str, tuple[float, float]],
    chain: list[str],
    probed_s: dict[str, tuple[float, float]] | None,
) -> dict[str, Any]:
    """CLUSTER.json from the measured records (see the module docstring); `chain` = peer ids in route order.

    decode_s_per_layer comes from the peers' own records, or, with `probed_s` ({peer: (seconds of a one-stage
    step at batch 1, at batch 8)}), from those client-side probes less the probe RTT, per held layer: that
    includes what a real step costs on the peer beyond the layers (deserialising, the executor queue).
    """
    cluster = cluster_from_snapshot(snap, PlannerConfig())
    if cluster is None:
        raise RuntimeError("no measured peer in the snapshot")
    data = cluster.to_json()
    for node in data["nodes"]:
        r = snap.peers[node["id"]]
        node["decode_s_per_layer"] = [
            [1, 1.0 / r.decode_layer_tokens_s_b1],
            [8, 8.0 / r.decode_layer_tokens_s_b8],
        ]
        if probed_s is not None:
            held, rtt_s = r.range_end - r.range_start, client_links[node["id"]][0]
            b1_s, b8_s = (max(t - rtt_s, 1e-6) / held for t in probed_s[node["id"]])
            node["decode_s_per_layer"] = [[1, b1_s], [8, max(b8_s, b1_s)]]
        node["prefill_s_per_layer"] = [
            [MEASURE_PREFILL_TOKENS, MEASURE_PREFILL_TOKENS / r.prefill_layer_tokens_s]
        ]
        node["cache_tokens"] = r.cache_tokens_total

    def one_way_s(a: str, b: str) -> float:
        if a == SOURCE or b == SOURCE:
            return client_links[b if a == SOURCE else a][0] / 2
        measured = snap.peers[a].links.get(b) or snap.peers[b].links.get(a)
        assert measured is not None  # wait_measured waited for every pair
        return measured.rtt_s / 2

    links = [lk for lk in data["links"] if lk["src"] not in (SOURCE,) and lk["dst"] not in (SINK,)]
    for lk in links:
        lk["latency_s"] = one_way_s(lk["src"], lk["dst"])
    for pid in chain:
        rtt_s, bw = client_links[pid]
        links.append({"src": SOURCE, "dst": pid, "bandwidth_bytes_s": bw, "latency_s": rtt_s / 2})
        # The reply retraces the route back to the client: from chain[k] through chain[k-1] ... chain[0].
        k = chain.index(pid)
        back = [*reversed(chain[: k + 1]), SOURCE]
        reply_s = sum(one_way_s(a, b) for a, b in zip(back, back[1:], strict=False))
        links.append({"src": pid, "dst": SINK, "bandwidth_bytes_s": bw, "latency_s": reply_s})
    data["links"] = links
    return data


def group_cpu_s(pgids: set[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of these process groups (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process just ended
            continue
        if int(fields[2]) in pgids:  # fields[2] = pgrp; fields[11], [12] = utime, stime
            total += int(fields[11]) + int(fields[12])
    return total / tick


def client_step_s(head: Any, repeats: int = 20) -> float:
    """Median time of the client's own work per decode token: embed one id, LM head on one hidden, argmax."""
    times = []
    hidden_size = head.embed(torch.tensor([1])).shape[-1]
    hidden = torch.randn(1, hidden_size)
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            head.embed(torch.tensor([1]))
            int(head.logits(hidden.to(torch.float32))[0].argmax())
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def one_session(client: AsyncSwarmClient, ids: list[int], new_tokens: int) -> float:
    """Greedy decode of one session; returns its end time."""
    session = client.new_session(len(ids) + new_tokens)
    try:
        logits = await session.forward(ids)
        token = int(logits.argmax())
        for _ in range(new_tokens - 1):
            logits = await session.forward([token])
            token = int(logits.argmax())
        return time.perf_counter()
    finally:
        await session.close()


async def probe_stage_s(client: AsyncSwarmClient, stage: Stage, batch: int, steps: int = 20) -> float:
    """Median seconds of one decode step of `batch` concurrent sessions sent to ONE peer (one-stage routes),
    as the client sees it; the peer's executor batches concurrent decode steps as it does when serving."""
    sessions = [SessionID(f"calibrate-{secrets.token_hex(6)}") for _ in range(batch)]
    context = 4
    max_length = context + steps + 1
    times = []
    try:
        hidden = client.head.embed(torch.tensor(prompt_ids(2, context, 0)))
        await asyncio.gather(*(client.chain.step(s, [stage], 0, hidden, max_length) for s in sessions))
        one = client.head.embed(torch.tensor([1]))
        for i in range(steps):
            t0 = time.perf_counter()
            await asyncio.gather(
                *(client.chain.step(s, [stage], context + i, one, max_length) for s in sessions)
            )
            times.append(time.perf_counter() - t0)
    finally:
        for s in sessions:
            await client.chain.close(s, [stage])
    return statistics.median(times)


async def measure_workload(
    initial_peers: list[str],
    model: str,
    vocab: int,
    stages: list[Stage],
    concurrency: int,
    prompt: int,
    new: int,
    repeats: int,
    pgids: set[int],
) -> tuple[list[float], float, dict[str, tuple[float, float]], float]:
    """Aggregate decode tokens/s of each repeat, the client's per-token head time, the one-stage decode
    step times of each peer at batch 1 and 8, and the CPU cores the swarm and client used during the
    repeats (CPU seconds of their process groups / wall seconds)."""
    client = await AsyncSwarmClient.create(initial_peers, model=model)
    try:
        await one_session(client, prompt_ids(vocab, prompt, 99), 2)  # warm-up: connections, first route
        head_s = client_step_s(client.head)
        step_s = {
            str(stage.peer_id): (await probe_stage_s(client, stage, 1), await probe_stage_s(client, stage, 8))
            for stage in stages
        }
        rates = []
        cpu0, wall0 = group_cpu_s(pgids), time.perf_counter()
        for _ in range(repeats):
            began = time.perf_counter()
            ends = await asyncio.gather(
                *(one_session(client, prompt_ids(vocab, prompt, c), new) for c in range(concurrency))
            )
            rates.append(concurrency * new / (max(ends) - began))
        cores = (group_cpu_s(pgids) - cpu0) / (time.perf_counter() - wall0)
        return rates, head_s, step_s, cores
    finally:
        await client.close()


def simulate(
    cluster: Cluster, placement: dict[NodeID, LayerRange], c: int, p: int, n: int, head_s: float
) -> float:
    """Aggregate decode tokens/s the simulator predicts for the same closed-loop workload."""
    plan = max_flow(cluster, placement, "measured")
    trace = [Request(i, 0.0, p, n) for i in range(c)]
    # max_batch_tokens = the peers' executor batch limit (swarm.peer.executor.ExecutorConfig.max_batch).
    config = SimConfig(max_batch_tokens=8, client_step_s=head_s)
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, config).run()
    end_s = max(sim.done_s)
    if min(sim.done_s) < 0:
        raise RuntimeError("the simulation did not finish every request")
    return sum(sim.generated) / end_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="default | tiny")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=".", help="where CLUSTER.json is written")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.model not in DEFAULT_RANGES:
        parser.error(f"--model must be one of {', '.join(DEFAULT_RANGES)}")
    if args.concurrency < 1 or args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("need --concurrency >= 1, --prompt-tokens >= 1, --new-tokens >= 2, --repeats >= 1")
    torch.set_num_threads(1)
    from swarm.models import resolve_model

    spec = resolve_model(args.model).spec
    ranges = DEFAULT_RANGES[args.model]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-calib-") as tmp,
        LocalSwarm(Path(tmp), model=args.model) as swarm,
    ):
        # One at a time: each peer measures its compute speed right after loading, and two peers measuring at
        # once on a 2-core machine would each announce a fraction of the speed they serve at.
        fixed = ["--no-follow-plan"]
        peers = [
            swarm.start_peer(layers=layers, name=name, timeout_s=args.timeout_s, extra_args=fixed)
            for name, layers in zip(("peer-a", "peer-b", "peer-c"), ranges, strict=True)
        ]
        swarm.wait_all_ready(timeout_s=args.timeout_s)
        chain = [p.peer_id for p in peers]
        snap, client_links = asyncio.run(
            wait_measured(swarm.initial_peers, spec.weights_hash, chain, args.timeout_s)
        )
        stages = [
            Stage(NodeID(pid), LayerRange(*map(int, r.split(":"))))
            for pid, r in zip(chain, ranges, strict=True)
        ]
        pgids = {os.getpgrp(), *(p.proc.pid for p in peers)}  # each peer leads its own group (with p2pd)
        rates, head_s, step_s, cores = asyncio.run(
            measure_workload(
                swarm.initial_peers,
                args.model,
                spec.vocab_size,
                stages,
                args.concurrency,
                args.prompt_tokens,
                args.new_tokens,
                args.repeats,
                pgids,
            )
        )
    data = build_cluster(snap, client_links, chain, step_s)
    (out_dir / "CLUSTER.json").write_text(json.dumps(data, indent=1))
    placement = {s.peer_id: s.layers for s in stages}
    workload = (args.concurrency, args.prompt_tokens, args.new_tokens, head_s)
    simulated = simulate(Cluster.from_json(data), placement, *workload)
    # The same with the decode tables the peers announced (measured once, at start-up, over 8 steps).
    announced = build_cluster(snap, client_links, chain, None)
    with_announced = simulate(Cluster.from_json(announced), placement, *workload)
    by_id = {node["id"]: node for node in announced["nodes"]}
    measured = statistics.median(rates)
    error = (simulated - measured) / measured
    report = {
        "model": spec.name,
        "peers": len(chain),
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "measured_decode_tokens_s": round(measured, 2),
        "simulated_decode_tokens_s": round(simulated, 2),
        "error_fraction": round(error, 4),
        "within_15pct": abs(error) <= 0.15,
        "measured_repeats_tokens_s": [round(r, 2) for r in rates],
        "simulated_with_announced_tables_tokens_s": round(with_announced, 2),
        "probed_step_s_b1_b8": [[round(t, 5) for t in step_s[p]] for p in chain],
        "announced_decode_s_per_layer_b1_b8": [
            [round(t, 5) for _, t in by_id[p]["decode_s_per_layer"]] for p in chain
        ],
        "client_step_s": round(head_s, 5),
        "swarm_cpu_cores_used": round(cores, 2),
        "machine_cores": os.cpu_count(),
        "cluster_json": str(out_dir / "CLUSTER.json"),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
