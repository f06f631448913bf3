#!/usr/bin/env python
"""The pause a client sees when a peer of its route is SIGKILLed mid-answer. Prints ONE JSON object.

Starts four `swarm-peer join` processes on 127.0.0.1 (first, middle, middle replica, last; nobody follows the
plan), connects a SwarmClient, and greedily decodes --new-tokens tokens (EOS ignored). After --kill-at tokens
the middle peer of the session's route is SIGKILLed (no wait: the signal is sent from the decode loop): with
`--kill process` (default) only the peer's own process, as `kill -9 PID` does, so its p2pd daemon and DHT child
live on for a while (a half-dead peer); with `--kill group` its
whole process group, p2pd included (connections then break at once); with `--kill stop` the whole group is
SIGSTOPped instead, like a machine that lost power or network: its connections stay open and nothing answers
(the case where only a deadline or a probe can tell). The group is SIGKILLed and reaped after the answer.
Per run: the gap between the token before the kill and the next token (pause_s), the largest other gap
(max_gap_healthy_s), failovers and how the client noticed the death (the failover log's reasons, when the
client keeps one). The output is also checked against a run with no kill (exact).

    .venv/bin/python scripts/bench_kill_pause.py                  # tiny model, 3 runs
    .venv/bin/python scripts/bench_kill_pause.py --model default --runs 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from client import SwarmClient  # noqa: E402
from client.generation import GenerationRequest, generate_ids  # noqa: E402
from swarm.models import Sampler, SamplingParams, resolve_model  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402
from swarm.testing.launcher import PeerProcess  # noqa: E402

FIXED = ["--no-follow-plan", "--record-ttl-s", "30"]
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


async def decode(
    client: SwarmClient,
    new_tokens: int,
    kill_at: int | None,
    by_id: dict[str, PeerProcess],
    how: str = "process",
) -> dict[str, Any]:
    """One greedy answer; with `kill_at`, the route's middle peer is SIGKILLed after that many tokens."""
    request = GenerationRequest(tuple(PROMPT), new_tokens, eos_ids=frozenset())
    session = client.aclient.new_session(len(PROMPT) + new_tokens)
    tokens, times, killed = [], [time.perf_counter()], None
    try:
        async for token in generate_ids(session, request, Sampler(SamplingParams()).sample):
            times.append(time.perf_counter())
            tokens.append(token)
            if kill_at is not None and len(tokens) == kill_at:
                killed = by_id[str(session.stages[1].peer_id)]
                with contextlib.suppress(
                    ProcessLookupError
                ):  # reaped later: waiting here would add to the gap
                    kill(killed.proc.pid, how)
    finally:
        await session.close()
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    log = getattr(session, "failover_log", [])
    return {
        "tokens": tokens,
        "killed": killed.name if killed else None,
        "pause_s": gaps[kill_at - 1] if kill_at is not None and kill_at - 1 < len(gaps) else None,
        "max_gap_healthy_s": max(
            (g for i, g in enumerate(gaps) if kill_at is None or i != kill_at - 1), default=0.0
        ),
        "failovers": session.failovers,
        "reasons": [f"{f.error}/{f.detected_by}" for f in log],
    }


def kill(pid: int, how: str) -> None:
    if how == "process":
        os.kill(pid, signal.SIGKILL)
    else:
        os.killpg(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step-timeout-s", type=float, default=30.0)
    parser.add_argument("--kill", choices=("process", "group", "stop"), default="process")
    args = parser.parse_args()
    if not 1 <= args.kill_at < args.new_tokens:
        parser.error("need 1 <= --kill-at < --new-tokens")
    torch.set_num_threads(1)
    n = resolve_model(args.model).spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    runs = []
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), model=args.model) as swarm:
        swarm.start_peer(layers=f"{cuts[0]}:{cuts[1]}", name="first", extra_args=FIXED, timeout_s=300)
        swarm.start_peer(layers=f"{cuts[2]}:{cuts[3]}", name="last", extra_args=FIXED, wait=False)
        for i in range(args.runs):
            swarm.start_peer(layers=f"{cuts[1]}:{cuts[2]}", name=f"middle{i}a", extra_args=FIXED, wait=False)
            swarm.start_peer(layers=f"{cuts[1]}:{cuts[2]}", name=f"middle{i}b", extra_args=FIXED, wait=False)
            swarm.wait_all_ready(timeout_s=300)
            by_id = {p.peer_id: p for p in swarm.peers}
            with SwarmClient(
                swarm.initial_peers, model=args.model, step_timeout_s=args.step_timeout_s
            ) as client:
                expected = client.run(decode(client, args.new_tokens, None, by_id))["tokens"]
                run = client.run(decode(client, args.new_tokens, args.kill_at, by_id, args.kill))
            run["exact"] = run.pop("tokens") == expected
            runs.append(run)
            for peer in swarm.peers:  # the survivor goes too: the next run kills a fresh pair's member
                if peer.name.startswith(f"middle{i}"):
                    peer.kill()  # SIGKILL also ends a SIGSTOPped group
            print(json.dumps(run), file=sys.stderr)
    pauses = [r["pause_s"] for r in runs if r["pause_s"] is not None]
    print(
        json.dumps(
            {
                "model": args.model,
                "kill": args.kill,
                "runs": runs,
                "pause_s": {"median": statistics.median(pauses), "max": max(pauses)} if pauses else None,
                "exact": all(r["exact"] for r in runs),
            }
        )
    )


if __name__ == "__main__":
    main()
