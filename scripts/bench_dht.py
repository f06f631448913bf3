#!/usr/bin/env python
"""Background traffic of idle swarms: bytes each peer sends and receives per second. Prints ONE JSON object.

For each swarm size N, N `swarm-peer join` processes of the tiny model (half on layers 0:3, half on 3:6), each
on a host of its own (a network namespace of swarm/testing/wan, links without delay; needs root), no client.
After --settle-s of settling, each host's TUN device counters are read at the start and the end of --window-s:
only what crosses the emulated network counts (a peer's talk with its own p2pd daemon stays on loopback).

  idle_tx_bytes_s_per_peer   {N: {"mean": .., "max": ..}}  bytes/s a peer sent (IP packets, headers included)
  idle_tx_bytes_s_busiest    {N: bytes/s} what the busiest peer sent ("max" above)
  idle_rx_bytes_s_per_peer   {N: {"mean": .., "max": ..}}  bytes/s a peer received
  by_cause                   at --by-cause-size peers, from the peers' own counters (--traffic-file): each
                             cause's {"tx", "rx"}, the mean per peer of the payload bytes/s it wrote and read
                             (swarm.dht.traffic.CAUSES), "unattributed" what the interface counted beyond them
                             (the DHT's copies to several nodes, framing, TCP/IP headers, its routing upkeep)
  by_cause_ablation          with --ablation: the swarm measured again with one periodic loop stretched to never
                             run again after start-up (--peer-args of each cause below); a cause's {"tx", "rx"}
                             is the mean per peer of the plain run minus that run's, and "rest" what is left with
                             all of them stretched. Two runs differ by noise too: a small or negative figure
                             means "lost in the noise".
  model_tx_bytes_s_per_peer  {N: bytes/s} an idle peer would send at N peers (1000 and 10000, and the measured
                             sizes to check the model against), from measured message sizes (model_tx)
  model_busiest_tx_bytes_s   {N: bytes/s} the busiest idle node, by the model: the mean peer plus the two
                             heaviest roles one node can have (storing a summary copy, a shard, the plan, the
                             lease key; planning), each in model_roles_tx_bytes_s
  peers                      with --per-peer: {N: [each peer's tx, rx, payload sent by cause, keys it stores]}

    sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_dht.py --json dht.json   # sizes 4 8 12 16
    sudo PYTHONPATH=$PWD .venv/bin/python scripts/bench_dht.py --quick           # 4 peers, short settle, window
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from swarm import PROTOCOL_VERSION  # noqa: E402
from swarm.dht import DirectoryConfig, ElectionConfig  # noqa: E402
from swarm.dht.node import REPLICAS_REFRESH_S  # noqa: E402
from swarm.dht.schemas import LeaseRecord, LinkMeasure, PeerRecord, SummaryRecord  # noqa: E402
from swarm.dht.traffic import payload_bytes  # noqa: E402
from swarm.dht.watch import WatchConfig  # noqa: E402
from swarm.peer.config import LinkConfig, PlannerConfig  # noqa: E402
from swarm.sim.background import Rates, Sizes, busiest_bytes_s, holder_bytes_s, model_bytes_s  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402
from swarm.testing.wan import EmulatedNet, LinkSpec  # noqa: E402
from swarm.testing.wan.bench import bench_main  # noqa: E402
from swarm.transport.linkprobe import ProbeSizes  # noqa: E402

PREFIX = "fsq"  # this benchmark's namespaces and devices (--prefix): fsq<N>-p<i>, fsq<N><i>
NEVER_S = "1000000"  # a loop interval longer than any run
CAUSES = {  # what each cause's loop is stretched by (swarm-peer join options)
    "link_probes": ["--link-refresh-s", NEVER_S, "--link-poll-s", NEVER_S],
    "summary_and_plan_reads": ["--watch-poll-s", NEVER_S, "--watch-fallback-s", NEVER_S],
    "planner_checks": ["--planner-check-interval-s", NEVER_S],
}


def log(message: str) -> None:
    print(f"[bench_dht {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 12, 16], help="swarm sizes (peers)")
    p.add_argument("--settle-s", type=float, default=30.0, help="idle time after every peer serves")
    p.add_argument("--window-s", type=float, default=60.0, help="the measured window")
    p.add_argument("--peer-args", default="", help="extra swarm-peer join arguments for every peer")
    p.add_argument("--by-cause-size", type=int, default=8, help="swarm size of the by_cause runs (0: none)")
    p.add_argument("--json", help="also write the JSON object here")
    p.add_argument("--prefix", default=PREFIX, help="name prefix of the namespaces and devices made")
    p.add_argument("--per-peer", action="store_true", help="also each peer's figures (tx, causes, keys)")
    p.add_argument("--logs", help="keep the peers' logs and traffic files under this directory")
    p.add_argument("--ablation", action="store_true", help="also by_cause_ablation: one more run per cause")
    p.add_argument(
        "--model-only", action="store_true", help="print the paper model alone (no swarm, no root)"
    )
    p.add_argument(
        "--quick", action="store_true", help="4 peers, 5 s settle, 10 s window, no by_cause (smoke)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.settle_s, args.window_s, args.by_cause_size = [4], 5.0, 10.0, 0
    if any(n < 2 for n in args.sizes) or args.window_s <= 0 or args.settle_s < 0 or args.by_cause_size == 1:
        p.error("sizes must be >= 2, --window-s > 0, --settle-s >= 0, --by-cause-size 0 or >= 2")
    return args


def device_bytes(net: EmulatedNet, host: str) -> tuple[int, int]:
    """(tx, rx) bytes so far of ``host``'s TUN device, read inside its namespace."""
    device = f"{net.prefix}{net.hosts.index(host)}"
    done = subprocess.run(
        ["ip", "-n", net.namespace(host), "-j", "-s", "link", "show", "dev", device],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = json.loads(done.stdout)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 1), "max": round(max(values), 1)}


def measure_size(n: int, args: argparse.Namespace, stretched: Sequence[str] = ()) -> dict[str, Any]:
    """One idle swarm of ``n`` peers: per-peer tx and rx bytes/s over the window."""
    extra = [*shlex.split(args.peer_args), *stretched]
    if args.logs:
        tmp = Path(args.logs) / f"n{n}-{len(stretched)}"
        tmp.mkdir(parents=True, exist_ok=True)
        return _measure_size(n, args, tmp, extra)
    with tempfile.TemporaryDirectory(prefix=f"bench_dht{n}_") as tmp_dir:
        return _measure_size(n, args, Path(tmp_dir), extra)


def read_traffic(path: Path) -> dict[str, Any] | None:
    """A peer's --traffic-file (None until it wrote one)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def counted(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """Bytes/s by cause between two --traffic-file reads of one peer (payloads as the peer counted them)."""
    if before is None or after is None or after["at"] <= before["at"]:
        return {}
    span = after["at"] - before["at"]
    return {
        cause: {
            "sent": (now["sent"] - before["by_cause"][cause]["sent"]) / span,
            "received": (now["received"] - before["by_cause"][cause]["received"]) / span,
        }
        for cause, now in after["by_cause"].items()
        if cause in before["by_cause"]
    }


def _measure_size(n: int, args: argparse.Namespace, tmp: Path, extra: list[str]) -> dict[str, Any]:
    hosts = [f"p{i}" for i in range(n)]
    with (
        EmulatedNet(f"{args.prefix}{n}", hosts, LinkSpec()) as net,
        LocalSwarm(tmp, model="tiny", net=net) as swarm,
    ):
        started = time.monotonic()
        files = {h: tmp / f"{h}.traffic.json" for h in hosts}

        def args_of(host: str) -> list[str]:
            return [*extra, "--traffic-file", str(files[host])]

        swarm.start_peer("0:3", name=hosts[0], host=hosts[0], extra_args=args_of(hosts[0]))
        for i, host in enumerate(hosts[1:], start=1):
            layers = "0:3" if i < n // 2 else "3:6"
            swarm.start_peer(layers, name=host, host=host, extra_args=args_of(host), wait=False)
        swarm.wait_all_ready(timeout_s=60.0 + 20.0 * n)
        log(f"{n} peers serving after {time.monotonic() - started:.0f} s; settling {args.settle_s:.0f} s")
        time.sleep(args.settle_s)
        before = {h: device_bytes(net, h) for h in hosts}
        traffic_before = {h: read_traffic(files[h]) for h in hosts}
        t0 = time.monotonic()
        time.sleep(args.window_s)
        after = {h: device_bytes(net, h) for h in hosts}
        traffic_after = {h: read_traffic(files[h]) for h in hosts}
        elapsed = time.monotonic() - t0
        for peer in swarm.peers:
            if peer.proc.poll() is not None:
                raise RuntimeError(f"peer {peer.name} exited during the window:\n{peer.log_tail()}")
    tx = [(after[h][0] - before[h][0]) / elapsed for h in hosts]
    rx = [(after[h][1] - before[h][1]) / elapsed for h in hosts]
    log(f"{n} peers: tx {statistics.fmean(tx) / 1024:.1f} KiB/s, rx {statistics.fmean(rx) / 1024:.1f} KiB/s")
    per_peer = [counted(traffic_before[h], traffic_after[h]) for h in hosts]
    causes = sorted({cause for peer in per_peer for cause in peer})
    by_cause = {
        cause: {
            way: round(statistics.fmean(peer.get(cause, {}).get(way, 0.0) for peer in per_peer), 1)
            for way in ("sent", "received")
        }
        for cause in causes
    }
    peers = [
        {
            "host": h,
            "tx": round(t, 1),
            "rx": round(r, 1),
            "sent_by_cause": {c: round(v["sent"], 1) for c, v in counts.items() if v["sent"] >= 0.5},
            "stores": [k.rsplit("_", 1)[-1] for k in (traffic_after[h] or {}).get("stores", [])],
        }
        for h, t, r, counts in zip(hosts, tx, rx, per_peer, strict=True)
    ]
    log("busiest: " + json.dumps(sorted(peers, key=lambda p: -p["tx"])[:3]))
    return {"tx": summary(tx), "rx": summary(rx), "counted": by_cause, "peers": peers}


def counted_causes(n: int, plain: dict[str, Any]) -> dict[str, Any]:
    """Mean tx and rx bytes/s per peer by cause, from the peers' own counters (see the module's doc)."""
    causes: dict[str, Any] = {"size": n, "method": "counters"}
    for cause, ways in plain["counted"].items():
        causes[cause] = {"tx": ways["sent"], "rx": ways["received"]}
    counted = [v for v in causes.values() if isinstance(v, dict)]
    causes["unattributed"] = {
        way: round(plain[way]["mean"] - sum(v[way] for v in counted), 1) for way in ("tx", "rx")
    }
    causes["total"] = {k: plain[k]["mean"] for k in ("tx", "rx")}
    return causes


def by_cause(n: int, args: argparse.Namespace, plain: dict[str, Any] | None) -> dict[str, Any]:
    """Mean tx and rx bytes/s per peer by cause, by ablation (see the module's doc); ``plain``: the plain run
    of ``n`` peers if it was measured already."""
    plain = plain or measure_size(n, args)
    causes: dict[str, Any] = {"size": n, "method": "ablation"}
    for cause, stretched in CAUSES.items():
        log(f"by_cause: {cause} stretched")
        without = measure_size(n, args, stretched)
        causes[cause] = {k: round(plain[k]["mean"] - without[k]["mean"], 1) for k in ("tx", "rx")}
    log("by_cause: all stretched")
    rest = measure_size(n, args, [a for stretched in CAUSES.values() for a in stretched])
    causes["rest"] = {k: rest[k]["mean"] for k in ("tx", "rx")}
    causes["total"] = {k: plain[k]["mean"] for k in ("tx", "rx")}
    return causes


MODEL_SIZES = (100, 1000, 10_000)
PEER_ID = "QmUchLdspnxAvHNc9kLG2UN65xWWQnFgf4L7x2KRr9cHdS"  # the length of a real peer id


def measured_sizes() -> Sizes:
    """The model's record sizes, from records as a peer of the tiny model writes them (k = 4 links)."""
    links = {
        PEER_ID[:-2] + f"{i:02d}": LinkMeasure(
            rtt_s=0.0123, bandwidth_bytes_s=1.25e7, reverse_bandwidth_bytes_s=1.2e7
        )
        for i in range(4)
    }
    record = PeerRecord(
        peer_id=PEER_ID,
        name=PEER_ID[-6:],
        maddrs=[f"/ip4/10.77.0.12/tcp/40123/p2p/{PEER_ID}"],
        protocol_version=PROTOCOL_VERSION,
        model_name="tiny-0",
        model_hash="f" * 64,
        num_layers=6,
        hidden_size=64,
        device="cpu",
        dtype="float32",
        memory_bytes=7_450_000_000,
        state="serving",
        range_start=0,
        range_end=3,
        decode_layer_tokens_s_b1=187.3,
        decode_layer_tokens_s_b8=771.2,
        prefill_layer_tokens_s=5072.9,
        max_layers=6,
        cache_tokens_total=8192,
        free_cache_tokens=8192,
        active_sessions=0,
        load=0.0,
        links=links,
        reachable=True,
        updated_at=1.8e9,
    )
    summary = SummaryRecord(
        planner_peer_id=PEER_ID, plan_epoch=12, peers_digest="0" * 16, peer_count=1000, created_at=1.8e9
    )
    lease = LeaseRecord(peer_id=PEER_ID, candidate_since=1.8e9, held_since=1.8e9, updated_at=1.8e9)
    return Sizes(
        peer_record_bytes=payload_bytes(record.to_dht()),
        summary_bytes=payload_bytes(summary.to_dht()),
        lease_bytes=payload_bytes(lease.to_dht()),
    )


def default_rates() -> Rates:
    """The model's rates, from the peer's default settings."""
    links, directory, election = LinkConfig(), DirectoryConfig(), ElectionConfig()
    return Rates(
        summary_poll_s=WatchConfig().poll_s,
        announce_s=directory.refresh_s,
        replicas_refresh_s=REPLICAS_REFRESH_S,
        link_refresh_s=links.refresh_s,
        pinged_peers=links.nearest + links.sample,
        pings=ProbeSizes().pings,
        bandwidth_refresh_s=links.bandwidth_refresh_s,
        nearest=links.nearest,
        lease_s=election.refresh_s,
        candidates=election.max_candidates,
        planner_check_s=PlannerConfig().check_interval_s,
        summary_write_s=directory.summary_refresh_s,
    )


def calibrated(sizes: Sizes, rates: Rates, measured: dict[int, float]) -> Sizes:
    """``sizes`` with the framing per message fitted to the ``measured`` mean bytes/s sent per peer (the least
    sum of squared relative errors, in steps of 10 bytes): the one figure the model cannot derive."""

    def error(message_bytes: int) -> float:
        fitted = replace(sizes, message_bytes=message_bytes)
        return sum((model_bytes_s(n, fitted, rates)["total"] / tx - 1) ** 2 for n, tx in measured.items())

    return replace(sizes, message_bytes=min(range(0, 2001, 10), key=error))


def model(sizes: Sequence[int], measured: dict[int, float] | None = None) -> dict[str, Any]:
    """The paper model (swarm.sim.background) at the measured sizes and at MODEL_SIZES, its framing per
    message fitted to ``measured`` ({size: mean bytes/s sent per peer}) when given."""
    record_sizes, rates = measured_sizes(), default_rates()
    if measured:
        record_sizes = calibrated(record_sizes, rates, measured)
    at = sorted({*sizes, *MODEL_SIZES})
    by_size = {n: model_bytes_s(n, record_sizes, rates) for n in at}
    return {
        "model_tx_bytes_s_per_peer": {str(n): round(m["total"], 1) for n, m in by_size.items()},
        "model_by_cause": {str(n): {k: round(v, 1) for k, v in m.items()} for n, m in by_size.items()},
        "model_busiest_tx_bytes_s": {str(n): round(busiest_bytes_s(n, record_sizes, rates), 1) for n in at},
        "model_roles_tx_bytes_s": {
            str(n): {k: round(v, 1) for k, v in holder_bytes_s(n, record_sizes, rates).items()} for n in at
        },
        "model_sizes": record_sizes.__dict__,
        "model_rates": rates.__dict__,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    results = {n: measure_size(n, args) for n in args.sizes}
    measured = {n: r["tx"]["mean"] for n, r in results.items()}
    report: dict[str, Any] = {
        "idle_tx_bytes_s_per_peer": {str(n): r["tx"] for n, r in results.items()},
        "idle_rx_bytes_s_per_peer": {str(n): r["rx"] for n, r in results.items()},
        "idle_tx_bytes_s_busiest": {str(n): r["tx"]["max"] for n, r in results.items()},
    }
    if args.per_peer:
        report["peers"] = {str(n): r["peers"] for n, r in results.items()}
    if args.by_cause_size:
        plain = results.get(args.by_cause_size) or measure_size(args.by_cause_size, args)
        report["by_cause"] = counted_causes(args.by_cause_size, plain)
        if args.ablation:
            report["by_cause_ablation"] = by_cause(args.by_cause_size, args, plain)
    return {
        **report,
        **model(args.sizes, measured),
        "settle_s": args.settle_s,
        "window_s": args.window_s,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model_only:
        print(json.dumps(model(args.sizes)))
        return
    bench_main("bench_dht", lambda: run(args), args.json)


if __name__ == "__main__":
    main()
