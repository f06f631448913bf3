#!/usr/bin/env python
"""Paired A/B of peer settings: two swarms side by side, their aggregate phases alternated. Prints ONE JSON object.

On a shared 2-vCPU machine one phase of the same code reads 27-37 tok/s from one minute to the next, so two
bench_e2e runs minutes apart cannot tell settings apart by less than that. Here swarm A (``--a`` peer
arguments) and swarm B (``--b``) run at once, each with its own client processes (scripts/bench_e2e.py's
workers), and every round runs each concurrency level on A and on B back to back, the order flipping each round:
both see the same minute of the machine. A swarm that is not measured idles. Reports per setting and level the
aggregate tokens/s of each round and their median, and per level the ratio B / A of each round and its median.

    .venv/bin/python scripts/bench_ab.py --b "--executor-ride-along-tokens 0" --rounds 6 --json ab.json
    .venv/bin/python scripts/bench_ab.py --quick                         # tiny model, small sizes (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as e2e  # noqa: E402  (sets FLOWSWARM_THREADS=1 for this process and its children)

from swarm.models import resolve_model  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402
from swarm.testing.prompts import chat_prompt_ids  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", default="", help="extra `swarm-peer join` arguments of swarm A, one string")
    parser.add_argument("--b", default="", help="extra `swarm-peer join` arguments of swarm B, one string")
    parser.add_argument("--json", metavar="OUT", help="also write the JSON object to this file")
    parser.add_argument("--quick", action="store_true", help="tiny model, small sizes (the CI smoke run)")
    parser.add_argument("--model", default=None, help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--rounds", type=int, default=None, help="rounds, each measuring A and B (6)")
    parser.add_argument("--sessions", type=int, nargs="+", default=None, help="concurrency levels (1 8)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per session (64)")
    args = parser.parse_args(argv)
    full = {"model": "default", "rounds": 6, "sessions": [1, 8], "tokens": 64}
    quick = {"model": "tiny", "rounds": 1, "sessions": [1, 2], "tokens": 6}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rounds < 1 or args.tokens < 2 or min(args.sessions) < 1:
        parser.error("need --rounds >= 1, --tokens >= 2, --sessions >= 1")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = resolve_model(args.model)
    ids = chat_prompt_ids(source, e2e.QUESTION)
    settings = {"A": args.a, "B": args.b}
    rates: dict[str, dict[str, list[float]]] = {k: {str(n): [] for n in args.sessions} for k in settings}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flowswarm-ab-")))
        workers: dict[str, e2e.Workers] = {}
        for name, peer_args in settings.items():
            (tmp / name).mkdir()
            swarm = stack.enter_context(LocalSwarm(tmp / name, model=args.model))
            e2e.start_swarm(swarm, e2e.parse_args(["--peer-args", peer_args]), source.spec.num_layers)
            swarm.wait_all_ready(timeout_s=300)
            spot = {"step_timeout_s": e2e.STEP_TIMEOUT_S}
            workers[name] = stack.enter_context(
                e2e.Workers(tmp / name, swarm.initial_peers, args.model, max(args.sessions), spot)
            )
        for each in workers.values():
            each.wait_ready()
        e2e.wait_quiet()
        for i in range(args.rounds):
            order = "AB" if i % 2 == 0 else "BA"
            for n in args.sessions:
                for name in order:
                    rate = e2e.aggregate_tok_s(workers[name].run_together(n, ids, args.tokens))
                    rates[name][str(n)].append(round(rate, 2))
                    e2e.log(f"round {i + 1}, {n} sessions, {name}: {rate:.2f} tok/s")
    levels = [str(n) for n in args.sessions]
    ratios = {n: [round(b / a, 3) for a, b in zip(rates["A"][n], rates["B"][n], strict=True)] for n in levels}
    return {
        "settings": settings,
        "model": source.spec.name,
        "tokens_per_session": args.tokens,
        "aggregate_tok_s": rates,
        "median_tok_s": {k: {n: statistics.median(v[n]) for n in levels} for k, v in rates.items()},
        "ratio_b_over_a": ratios,
        "median_ratio_b_over_a": {n: statistics.median(v) for n, v in ratios.items()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # a SIGTERM (timeout, CI) unwinds like an exception, so the `with` blocks stop the peers and clients
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    text = json.dumps(run(args))
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
