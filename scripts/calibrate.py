#!/usr/bin/env python
"""Calibrate the simulator against a real 3-peer loopback swarm. Prints ONE JSON object.

1. Starts three `swarm-peer join --no-follow-plan --no-plan` processes on 127.0.0.1 with fixed ranges
   (0:10/10:20/20:30 for the default model, 0:2/2:4/4:6 for tiny) and waits until they announce measured
   numbers. No peer plans: the placement is fixed, and a re-plan would take a core in the middle of a probe.
2. Probes, from the client, what the simulator needs, and builds CLUSTER.json from it and the peers'
   records (written to --out-dir; swarm/sim/calibration.py turns probes into node fields):
   * decode_s_per_layer of each peer: CPU seconds its process group (the peer and its p2pd) spends per
     one-stage decode step at batch 1 and 8 (PROBE_STEPS steps), per held layer. CPU, not wall time: three
     peers and the client share this machine, so what they cost it is what the simulator must charge;
   * forward_s: the extra CPU seconds a peer spends per session-step it forwards (two-stage route less
     one-stage), the mean over forwarding peers;
   * the client's CPU seconds per decode token of one session (this process group: embedding, RPC,
     bookkeeping, LM head) -> SimConfig.client_step_s, with the client on the same host;
   * host "loopback" with this machine's cores, and host_parallel_speed: a peer's step time alone over its
     step time while another peer steps at once. Two decodes on idle cores still slow each other (each step
     streams the weights from memory; the measured range is in docs/benchmarks.md); swarm/sim/hosts.py
     models both;
   * links: loopback latency 0 (an RPC's round trip is CPU work, already counted above), measured bandwidth.
   Also reported: route_cpu_s_per_token (every process, one session) against what the simulator charges.
3. Measures end to end for each concurrency C: C concurrent greedy sessions (AsyncSwarmClient, P prompt
   tokens, N new tokens, EOS ignored), `--repeats` times; aggregate decode tokens/s = all generated tokens /
   time from start to the last session's end; the median is compared.
4. Simulates the same workloads (swarm.sim.calibration: same placement, C requests at t=0 = a closed loop
   of C sessions, same lengths) and reports the error. For comparison it also reports the simulation without the shared host
   (each peer a core of its own) and with the peers' announced start-up tables.

    .venv/bin/python scripts/calibrate.py                        # default model, C = 1, 2, 4, 8
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

import torch  # noqa: E402

from client import AsyncSwarmClient  # noqa: E402
from swarm.dht import SwarmSnapshot  # noqa: E402
from swarm.models import ModelSpec, resolve_model  # noqa: E402
from swarm.peer.config import PlannerConfig  # noqa: E402
from swarm.peer.planner_service import cluster_from_snapshot  # noqa: E402
from swarm.planner import Cluster  # noqa: E402
from swarm.routing.route import Stage  # noqa: E402
from swarm.sim.calibration import Measured, Probed, apply_probes, compare_run, probe_report  # noqa: E402
from swarm.testing import LocalSwarm, swarm_client  # noqa: E402
from swarm.transport.calls import measure_link  # noqa: E402
from swarm.types import SINK, SOURCE, LayerRange, NodeID, SessionID  # noqa: E402

DEFAULT_RANGES = {"default": ("0:10", "10:20", "20:30"), "tiny": ("0:2", "2:4", "4:6")}
MEASURE_PREFILL_TOKENS = 128
PROBE_STEPS = 48  # decode steps per probe: CPU readings have 10 ms resolution (one clock tick)
FORWARD_STEPS = 96  # swarm.peer.measure.measure_compute's prefill length


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
            timing = await measure_link(p2p, pid, maddrs=tuple(snap.peers[pid].maddrs))
            client_links[pid] = (timing.rtt_s, timing.up_bytes_s)
        return snap, client_links


def build_cluster(
    snap: SwarmSnapshot,
    client_links: dict[str, tuple[float, float]],
    chain: list[str],
    probed: Probed | None,
) -> dict[str, Any]:
    """CLUSTER.json from the measured records (see the module docstring); `chain` = peer ids in route order.

    decode_s_per_layer comes from the peers' own records, or, with `probed`, from the probes
    (swarm.sim.calibration.apply_probes); all nodes then share this machine's cores (host "loopback").
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
        if probed is not None:
            apply_probes(node, r.range_end - r.range_start, probed, os.cpu_count() or 1)
        node["prefill_s_per_layer"] = [
            [MEASURE_PREFILL_TOKENS, MEASURE_PREFILL_TOKENS / r.prefill_layer_tokens_s]
        ]
        node["cache_tokens"] = r.cache_tokens_total

    def one_way_s(a: str, b: str) -> float:
        if probed is not None:
            # On loopback an RPC's round trip is CPU work (serialising, the p2pd relays, the handler) that the
            # probed CPU seconds already count; the wire itself adds microseconds.
            return 0.0
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


async def route_cpu_per_token_s(
    client: AsyncSwarmClient, ids: list[int], everyone: set[int], steps: int = 48
) -> tuple[float, float]:
    """CPU seconds per decode token of one session over the whole route: used by the client's processes
    (this one and its p2pd: embedding, the RPC, bookkeeping, LM head, argmax), and by every process of the
    testbed (process groups `everyone`)."""
    session = client.new_session(len(ids) + steps + 1)
    try:
        token = int((await session.forward(ids)).argmax())
        own0, all0 = group_cpu_s({os.getpgrp()}), group_cpu_s(everyone)
        for _ in range(steps):
            token = int((await session.forward([token])).argmax())
        return (group_cpu_s({os.getpgrp()}) - own0) / steps, (group_cpu_s(everyone) - all0) / steps
    finally:
        await session.close()


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


async def probe_routes(
    client: AsyncSwarmClient,
    routes: list[list[Stage]],
    pgids: dict[str, int],
    steps: int = PROBE_STEPS,
) -> tuple[float, dict[str, float]]:
    """One session per route, every decode step sent to all of them at the same moment (a peer's executor
    batches those it gets together, as when serving): the median seconds of a step as the client sees it,
    and the CPU seconds per step used by each peer's process group (the peer and its p2pd) in `pgids`."""
    sessions = [SessionID(f"calibrate-{secrets.token_hex(6)}") for _ in routes]
    pairs = list(zip(sessions, routes, strict=True))
    context = 4
    max_length = context + steps + 1
    times = []
    try:
        hidden = client.head.embed(torch.tensor(prompt_ids(2, context, 0)))
        await asyncio.gather(*(client.chain.step(s, r, 0, hidden, max_length) for s, r in pairs))
        one = client.head.embed(torch.tensor([1]))
        cpu0 = {peer: group_cpu_s({pgid}) for peer, pgid in pgids.items()}
        for i in range(steps):
            t0 = time.perf_counter()
            await asyncio.gather(*(client.chain.step(s, r, context + i, one, max_length) for s, r in pairs))
            times.append(time.perf_counter() - t0)
        cpu = {peer: (group_cpu_s({pgid}) - cpu0[peer]) / steps for peer, pgid in pgids.items()}
    finally:
        for s, r in pairs:
            await client.chain.close(s, r)
    return statistics.median(times), cpu


async def probe_peers(client: AsyncSwarmClient, stages: list[Stage], pgids: dict[str, int]) -> Probed:
    step_cpu_s, step_wall_s, forward_s = {}, {}, {}
    for stage in stages:
        peer = str(stage.peer_id)
        walls, cpus = [], []
        for batch in (1, 8):
            wall, cpu = await probe_routes(client, [[stage]] * batch, {peer: pgids[peer]})
            walls.append(wall)
            cpus.append(cpu[peer])
        step_wall_s[peer] = (walls[0], walls[1])
        step_cpu_s[peer] = (cpus[0], cpus[1])
    extra = []
    for stage, after in zip(stages, stages[1:], strict=False):
        # A peer that forwards serialises the hidden state and makes the RPC the client makes for a
        # one-stage step, then relays the answer back: measured as its extra CPU on a two-stage route.
        peer = str(stage.peer_id)
        _, cpu = await probe_routes(client, [[stage, after]], {peer: pgids[peer]}, steps=FORWARD_STEPS)
        extra.append(cpu[peer] - step_cpu_s[peer][0])
    # The same code forwards on every peer; a difference of two CPU readings of 10 ms resolution is noisy,
    # so every forwarding peer is charged the mean.
    for stage in stages[:-1]:
        forward_s[str(stage.peer_id)] = max(statistics.mean(extra), 0.0)
    everyone = {os.getpgrp(), *pgids.values()}
    client_cpu_s, route_cpu_s = await route_cpu_per_token_s(client, prompt_ids(2, 8, 1), everyone)
    speed = await parallel_speed(client, stages[0], stages[-1])
    return Probed(step_cpu_s, step_wall_s, forward_s, client_cpu_s, route_cpu_s, min(speed, 1.0))


async def parallel_speed(client: AsyncSwarmClient, first: Stage, second: Stage, rounds: int = 3) -> float:
    """How fast two peers step while both do at once, relative to each alone: the median over `rounds` of
    (slower one-stage step alone) / (both stepping together, each step sent to both at the same moment).
    Cores are not all they share: each peer's event loop and torch thread contend for its GIL while the
    other session's messages pass through, and memory bandwidth is shared."""
    ratios = []
    for _ in range(rounds):
        alone = [(await probe_routes(client, [[stage]], {}))[0] for stage in (first, second)]
        together, _ = await probe_routes(client, [[first], [second]], {})
        ratios.append(max(alone) / together)
    return statistics.median(ratios)


async def measure_workload(
    initial_peers: list[str],
    model: str,
    vocab: int,
    stages: list[Stage],
    concurrencies: list[int],
    prompt: int,
    new: int,
    repeats: int,
    pgids: dict[str, int],
) -> Measured:
    """The probes, then for each concurrency C the aggregate decode tokens/s of each repeat of C concurrent
    sessions and the CPU cores the swarm and client used meanwhile (CPU seconds of their process groups /
    wall seconds)."""
    client = await AsyncSwarmClient.create(initial_peers, model=model)
    everyone = {os.getpgrp(), *pgids.values()}
    try:
        await one_session(client, prompt_ids(vocab, prompt, 99), 2)  # warm-up: connections, first route
        measured = Measured(await probe_peers(client, stages, pgids))
        for concurrency in concurrencies:
            rates = []
            cpu0, wall0 = group_cpu_s(everyone), time.perf_counter()
            for _ in range(repeats):
                began = time.perf_counter()
                ends = await asyncio.gather(
                    *(one_session(client, prompt_ids(vocab, prompt, c), new) for c in range(concurrency))
                )
                rates.append(concurrency * new / (max(ends) - began))
            measured.rates[concurrency] = rates
            measured.cores[concurrency] = (group_cpu_s(everyone) - cpu0) / (time.perf_counter() - wall0)
        return measured
    finally:
        await client.close()


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"need comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need concurrencies >= 1, got {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="default | tiny")
    parser.add_argument(
        "--concurrency", type=parse_concurrencies, default=[1, 2, 4, 8], help="e.g. 1,2,4,8: one run each"
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=".", help="where CLUSTER.json is written")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.model not in DEFAULT_RANGES:
        parser.error(f"--model must be one of {', '.join(DEFAULT_RANGES)}")
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("need --prompt-tokens >= 1, --new-tokens >= 2, --repeats >= 1")
    return args


def run_testbed(
    args: argparse.Namespace, spec: ModelSpec
) -> tuple[SwarmSnapshot, dict[str, tuple[float, float]], list[str], list[Stage], Measured]:
    """Start the three peers, wait for their measurements, probe them and measure the workloads."""
    ranges = DEFAULT_RANGES[args.model]
    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-calib-") as tmp,
        LocalSwarm(Path(tmp), model=args.model) as swarm,
    ):
        # One at a time: each peer measures its compute speed right after loading, and two peers measuring at
        # once on a 2-core machine would each announce a fraction of the speed they serve at.
        # The placement is fixed, and no peer stands for planner: a re-plan (its full time limit on one core
        # when the fixed placement is not optimal) would steal CPU from serving in the middle of a probe.
        fixed = ["--no-follow-plan", "--no-plan"]
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
        pgids = {p.peer_id: p.proc.pid for p in peers}  # each peer leads its own group (with its p2pd)
        measured = asyncio.run(
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
    return snap, client_links, chain, stages, measured


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = resolve_model(args.model).spec
    snap, client_links, chain, stages, measured = run_testbed(args, spec)
    data = build_cluster(snap, client_links, chain, measured.probed)
    (out_dir / "CLUSTER.json").write_text(json.dumps(data, indent=1))
    # The same with the decode tables the peers announced (measured once, at start-up, over 8 steps).
    announced = build_cluster(snap, client_links, chain, None)
    placement = {s.peer_id: s.layers for s in stages}
    cluster, announced_cluster = Cluster.from_json(data), Cluster.from_json(announced)
    runs = [
        compare_run(measured, cluster, announced_cluster, placement, (c, args.prompt_tokens, args.new_tokens))
        for c in args.concurrency
    ]
    report = {
        "model": spec.name,
        "peers": len(chain),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "runs": runs,
        "within_15pct": all(run["within_15pct"] for run in runs),
        "worst_error_fraction": max((run["error_fraction"] for run in runs), key=abs),
        **probe_report(measured.probed, announced, chain),
        "machine_cores": os.cpu_count(),
        "cluster_json": str(out_dir / "CLUSTER.json"),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
