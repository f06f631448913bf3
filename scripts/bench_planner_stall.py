#!/usr/bin/env python
"""Does a planner solve stall the serving peer? Event-loop lag while the planner solves, in a thread of this
process (how it ran before) vs the niced solver process the live planner uses now (swarm.peer.solver_process).

A ticker on the event loop sleeps 5 ms at a time and records how late it wakes: any RPC a peer answers waits
at least that long. The solve is swarm.planner.solve on a synthetic cluster (helix24 by default) with the
MILP and a time limit. Prints one JSON object: lag p50 / p99 / max (ms) for each way, and the solve times.

    .venv/bin/python scripts/bench_planner_stall.py [--cluster helix24|random48] [--time-limit-s 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from swarm.peer.solver_process import InThread, SolverProcess
from swarm.planner.cluster import Cluster
from swarm.planner.solve import solve
from swarm.planner.synthetic import helix_24, random_cluster

TICK_S = 0.005


async def lag_while(work: asyncio.Future[object]) -> list[float]:
    """How late (s) each 5 ms tick woke while `work` ran."""
    lags = []
    while not work.done():
        began = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(time.perf_counter() - began - TICK_S)
    return lags


async def measure(solver: SolverProcess | InThread, cluster: Cluster, limit_s: float) -> dict[str, float]:
    await solver.run(
        solve, cluster, method="greedy", time_limit_s=1.0
    )  # start-up (spawn, imports) not counted
    began = time.perf_counter()
    work = asyncio.ensure_future(solver.run(solve, cluster, method="milp", time_limit_s=limit_s))
    lags = sorted(await lag_while(work))
    plan = await work
    solver.close()
    return {
        "solve_s": time.perf_counter() - began,
        "max_flow_tokens_s": plan.max_flow_tokens_s,
        "lag_ms_p50": 1000 * statistics.median(lags),
        "lag_ms_p99": 1000 * lags[int(0.99 * (len(lags) - 1))],
        "lag_ms_max": 1000 * lags[-1],
        "ticks": len(lags),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cluster", choices=["helix24", "random48"], default="helix24")
    parser.add_argument("--time-limit-s", type=float, default=8.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cluster = helix_24() if args.cluster == "helix24" else random_cluster(48, num_regions=2, seed=1)
    result = {
        "benchmark": "bench_planner_stall",
        "cluster": args.cluster,
        "time_limit_s": args.time_limit_s,
        "in_thread": asyncio.run(measure(InThread(), cluster, args.time_limit_s)),
        "solver_process": asyncio.run(measure(SolverProcess(), cluster, args.time_limit_s)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
