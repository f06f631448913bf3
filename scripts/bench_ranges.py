#!/usr/bin/env python
"""Decode speed of 3 peers on the layer ranges they were loaded at, moved to, or hold under a memory budget.
Prints ONE JSON object.

Each layout is a fresh swarm of 3 `swarm-peer join` processes on 127.0.0.1, one torch thread each, in order:

  kept         at 0:10 / 10:20 / 20:30 (equal thirds of the model's layers), --no-follow-plan
  moved        joined at the same ranges with the planner on (the default), measured once every peer serves
               the published plan's range and the ranges held still for --settle-s (or --move-timeout-s passed)
  direct       started at the ranges `moved` ended at, --no-follow-plan
  kept_budget  like kept, with --max-memory-gb 0.33 (what scripts/demo passes)

Per layout: one greedy session's decode tokens/s after the first token (best of --repeats), the aggregate of
--clients client processes generating at once (scripts/bench_e2e.py's client processes and window), the peers'
ranges, and whether its greedy tokens equal local transformers'. `ratios` compares each layout with `kept`.

    .venv/bin/python scripts/bench_ranges.py --json ranges.json     # default model, 64 tokens, 4 clients
    .venv/bin/python scripts/bench_ranges.py --quick                # tiny model, few tokens (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from bench_e2e import (  # noqa: E402  # scripts/ is this script's own directory, first on sys.path
    QUESTION,
    STEP_TIMEOUT_S,
    Workers,
    aggregate_tok_s,
    layer_cuts,
    swarm_decode,
    wait_quiet,
)

from client import SwarmClient  # noqa: E402
from swarm.dht import SwarmSnapshot  # noqa: E402
from swarm.models import resolve_model  # noqa: E402
from swarm.testing import LocalSwarm, greedy_reference, swarm_client  # noqa: E402
from swarm.testing.prompts import chat_prompt_ids  # noqa: E402
from swarm.types import Plan  # noqa: E402

LAYOUTS = ("kept", "moved", "direct", "kept_budget")
BUDGET_GB = 0.33  # scripts/demo's --max-memory-gb
# The quick run's planner and follower act within seconds, so `moved` settles in a CI-sized wait.
QUICK_PLANNER_ARGS = [
    "--record-ttl-s", "15",
    "--planner-lease-s", "3",
    "--planner-check-interval-s", "1",
    "--follow-check-interval-s", "1",
    "--follow-session-grace-s", "2",
]  # fmt: skip


def log(message: str) -> None:
    print(f"[bench_ranges {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="OUT", help="also write the JSON object to this file")
    parser.add_argument("--quick", action="store_true", help="tiny model, few tokens (the CI smoke run)")
    parser.add_argument("--model", default=None, help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per session (64)")
    parser.add_argument("--clients", type=int, default=None, help="client processes generating at once (4)")
    parser.add_argument("--repeats", type=int, default=None, help="one session's best of this many (2)")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument(
        "--direct-ranges", nargs=3, metavar="A:B", help="direct's ranges when moved is not run (else moved's)"
    )
    parser.add_argument("--move-timeout-s", type=float, default=None, help="longest wait for moved (900)")
    parser.add_argument("--settle-s", type=float, default=None, help="moved's ranges held this long (20)")
    parser.add_argument("--quiet-s", type=float, default=None, help="longest wait for an idle machine (90)")
    args = parser.parse_args(argv)
    full = {"model": "default", "new_tokens": 64, "clients": 4, "repeats": 2, "move_timeout_s": 900.0,
            "settle_s": 20.0, "quiet_s": 90.0}  # fmt: skip
    quick = {"model": "tiny", "new_tokens": 6, "clients": 2, "repeats": 1, "move_timeout_s": 240.0,
             "settle_s": 3.0, "quiet_s": 0.0}  # fmt: skip
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 2 or args.clients < 1 or args.repeats < 1:
        parser.error("need --new-tokens >= 2, --clients >= 1, --repeats >= 1")
    if "direct" in args.layouts and "moved" not in args.layouts and not args.direct_ranges:
        parser.error("direct starts at the ranges moved ended at: run moved too, or give --direct-ranges")
    return args


def peer_args(layout: str, quick: bool) -> list[str]:
    """`swarm-peer join` arguments every peer of `layout` gets besides its --layers."""
    extra = QUICK_PLANNER_ARGS if quick else []
    if layout == "moved":
        return list(extra)
    fixed = [*extra, "--no-follow-plan"]
    return [*fixed, "--max-memory-gb", str(BUDGET_GB)] if layout == "kept_budget" else fixed


def range_text(start: int, end: int) -> str:
    return f"{start}:{end}"


def follows_plan(snapshot: SwarmSnapshot, peer_ids: Sequence[str]) -> bool:
    """Every peer serves exactly its range in the published plan and no older range besides."""
    if snapshot.plan is None:
        return False
    placement = Plan.from_json(snapshot.plan.plan).placement
    serving = snapshot.serving()
    for pid in peer_ids:
        record, planned = serving.get(pid), placement.get(pid)  # type: ignore[call-overload]
        if record is None or planned is None or record.older_ranges:
            return False
        if (record.range_start, record.range_end) != (planned.start, planned.end):
            return False
    return True


async def wait_for_plan(
    initial_peers: Sequence[str],
    model_hash: str,
    names: Mapping[str, str],
    started: Sequence[str],
    timeout_s: float,
    settle_s: float,
) -> dict[str, Any]:
    """Poll the DHT until every peer follows the plan and the ranges held still for `settle_s` (or the timeout
    passed): each peer's last announced range (by name), every distinct range each announced, and whether it
    settled. `started`: the peers' ranges at join, in name order, for a peer never seen serving."""
    seen: dict[str, list[str]] = {name: [] for name in names.values()}
    began = time.monotonic()
    still: tuple[dict[str, str], float] | None = None  # (ranges, since) while every peer follows the plan
    async with swarm_client(initial_peers, model_hash) as (_dht, directory, _p2p):
        while True:
            snapshot = await directory.snapshot()
            now = time.monotonic()
            serving = snapshot.serving()
            ranges = {
                names[pid]: range_text(r.range_start, r.range_end)
                for pid, r in serving.items()
                if pid in names
            }
            for name, held in ranges.items():
                if not seen[name] or seen[name][-1] != held:
                    seen[name].append(held)
            if not follows_plan(snapshot, list(names)):
                still = None
            elif still is None or still[0] != ranges:
                still = (ranges, now)
            settled = still is not None and now - still[1] >= settle_s
            if settled or now - began > timeout_s:
                return {
                    "ranges": [
                        seen[name][-1] if seen[name] else start
                        for name, start in zip(sorted(seen), started, strict=True)
                    ],
                    "ranges_seen": seen,
                    "settled": settled,
                    "settle_s": round(now - began, 1),
                }
            await asyncio.sleep(1.0)


def measure(
    swarm: LocalSwarm, model: str, ids: list[int], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """One session's best decode tokens/s and its tokens, then the client processes' aggregate."""
    options = {"step_timeout_s": STEP_TIMEOUT_S}
    best, tokens = 0.0, None
    with SwarmClient(swarm.initial_peers, model=model, **options) as client:  # type: ignore[arg-type]
        for _ in range(args.repeats):
            tok_s, got = client.run(swarm_decode(client.aclient, ids, args.new_tokens))
            best = max(best, tok_s)
            if tokens is not None and got != tokens:
                raise RuntimeError(f"one swarm gave two greedy answers: {tokens} and {got}")
            tokens = got
    with Workers(tmp, swarm.initial_peers, model, args.clients, options) as workers:
        workers.wait_ready()
        aggregate = aggregate_tok_s(workers.run_together(args.clients, ids, args.new_tokens))
    return {"decode_tok_s": round(best, 2), "aggregate_tok_s": round(aggregate, 2), "tokens": tokens}


def run_layout(
    layout: str, ranges: Sequence[str], ids: list[int], args: argparse.Namespace, model_hash: str, tmp: Path
) -> dict[str, Any]:
    """Start 3 peers at `ranges` with the layout's arguments, wait for them (and for moved, the plan), measure."""
    extra = peer_args(layout, args.quick)
    result: dict[str, Any] = {"started_at": list(ranges), "peer_args": extra}
    (tmp / layout).mkdir()
    with LocalSwarm(tmp / layout, model=args.model) as swarm:
        for i, layers in enumerate(ranges):
            swarm.start_peer(layers=layers, name=f"peer-{i}", wait=i == 0, timeout_s=300, extra_args=extra)
        swarm.wait_all_ready(timeout_s=300)
        result["ranges"] = list(ranges)
        if layout == "moved":
            names = {peer.peer_id: peer.name for peer in swarm.peers}
            log(f"{layout}: peers serving {list(ranges)}; waiting for them to follow the plan")
            moved = asyncio.run(
                wait_for_plan(
                    swarm.initial_peers, model_hash, names, ranges, args.move_timeout_s, args.settle_s
                )
            )
            result.update(moved)
            if not moved["settled"]:
                log(f"{layout}: not settled after {args.move_timeout_s:.0f} s; measuring {moved['ranges']}")
        wait_quiet(args.quiet_s)
        log(f"{layout}: measuring at {result['ranges']}")
        result.update(measure(swarm, args.model, ids, args, tmp / layout))
    log(f"{layout}: {result['decode_tok_s']} tok/s, {args.clients} clients {result['aggregate_tok_s']} tok/s")
    return result


def ratios(layouts: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Each layout's tokens/s over kept's (one session, and `aggregate_` for the client processes)."""
    out: dict[str, float | None] = {}
    for name, key in (
        ("moved", "moved_vs_kept"),
        ("direct", "direct_vs_kept"),
        ("kept_budget", "budget_vs_kept"),
    ):
        for field, prefix in (("decode_tok_s", ""), ("aggregate_tok_s", "aggregate_")):
            kept = layouts.get("kept", {}).get(field)
            other = layouts.get(name, {}).get(field)
            out[prefix + key] = round(other / kept, 3) if kept and other is not None else None
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    source = resolve_model(args.model)
    ids = chat_prompt_ids(source, QUESTION)
    cuts = layer_cuts(source.spec.num_layers, 3)
    thirds = [range_text(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    reference = greedy_reference(source, ids, args.new_tokens)
    log(f"local transformers: {args.new_tokens} greedy tokens")
    layouts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="flowswarm-ranges-") as tmp:
        for layout in (name for name in LAYOUTS if name in args.layouts):
            if layout == "direct":
                start = args.direct_ranges or layouts["moved"]["ranges"]
            else:
                start = thirds
            layouts[layout] = run_layout(layout, start, ids, args, source.spec.weights_hash, Path(tmp))
    answers = [each.pop("tokens") for each in layouts.values()]
    for each, tokens in zip(layouts.values(), answers, strict=True):
        each["tokens_match"] = tokens == reference
    return {
        "model": source.spec.name,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "clients": args.clients,
        "repeats": args.repeats,
        "layouts": layouts,
        "ratios": ratios(layouts),
        "tokens_equal": all(tokens == reference for tokens in answers),
        "total_s": round(time.perf_counter() - began, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "threads_per_process": torch.get_num_threads(),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # a SIGTERM (timeout, CI) unwinds like an exception, so the `with` blocks stop the peers and clients
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    text = json.dumps(report)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
