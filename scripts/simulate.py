#!/usr/bin/env python3
"""Simulate serving on a cluster: placements x schedulings, online or offline, optionally with churn.

    scripts/simulate.py CLUSTER.json [--mode online|offline] [--requests N]
        [--placements milp,greedy,swarm,separate] [--scheduling iwrr,random,swarm] [--seed S]
        [--json OUT] [--png PLOT] [--churn SCHEDULE.json]

CLUSTER.json is the planner's format (swarm/planner/cluster.py), optionally with measured timing tables per
node (swarm/sim/timing.py) and "cache_tokens"; "helix24", "helix42" or "randomN" name synthetic clusters.
Prints {"rows": [...]} as JSON (one row per placement x scheduling).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from swarm.sim.churn import Churn, initially_absent, load_schedule, present_cluster  # noqa: E402
from swarm.sim.engine import SimConfig, Simulation  # noqa: E402
from swarm.sim.report import plot, summarize  # noqa: E402
from swarm.sim.scheduling import router_factory  # noqa: E402
from swarm.sim.trace import TraceConfig, make_trace  # noqa: E402

from swarm.planner import synthetic  # noqa: E402
from swarm.planner.cluster import Cluster, load_cluster  # noqa: E402
from swarm.planner.graph import max_flow  # noqa: E402
from swarm.planner.solve import HEURISTICS, solve  # noqa: E402
from swarm.types import LayerRange, NodeID, Plan  # noqa: E402

logger = logging.getLogger("simulate")

PLACEMENTS = ("milp", "search", "greedy", "swarm", "separate")
SCHEDULINGS = ("iwrr", "random", "swarm")


def cluster_from_arg(arg: str) -> Cluster:
    if arg == "helix24":
        return synthetic.helix_24()
    if arg == "helix42":
        return synthetic.helix_42()
    if arg.startswith("random") and arg[6:].isdigit():
        return synthetic.random_cluster(int(arg[6:]), seed=1)
    return load_cluster(arg)


def make_plan(
    cluster: Cluster, method: str, time_limit_s: float, current: dict[NodeID, LayerRange] | None = None
) -> Plan:
    if method in HEURISTICS and current is None:
        # The heuristics' placement through max flow directly: solve() adds nothing for them but its checks.
        return max_flow(cluster, HEURISTICS[method](cluster), method)
    return solve(cluster, method, time_limit_s=time_limit_s, current=current)


def parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"bad {what} {bad or text!r}: choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", help="CLUSTER.json, or helix24 / helix42 / randomN for a synthetic cluster")
    p.add_argument("--mode", choices=("online", "offline"), default="online")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--placements", default="milp,greedy,swarm")
    p.add_argument("--scheduling", default="iwrr,random,swarm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--load",
        type=float,
        default=0.75,
        help="online arrival rate as a fraction of max flow (a prompt token counts as prefill_token_cost of "
        "a decode token)",
    )
    p.add_argument("--plan-time-limit-s", type=float, default=20.0, help="MILP / search time limit")
    p.add_argument("--reload-s-per-layer", type=float, default=1.0, help="churn: time to load one layer")
    p.add_argument(
        "--cache-layer-tokens",
        type=int,
        default=SimConfig.cache_layer_tokens,
        help="KV cache of nodes without cache_tokens, in tokens x layers (split over the layers they hold)",
    )
    p.add_argument(
        "--decode-quantum",
        type=int,
        default=1,
        help="decode tokens per simulated pass (1 = exact; larger is faster and coarser, for huge runs)",
    )
    p.add_argument("--json", dest="json_out", help="write the result JSON here too")
    p.add_argument("--png", help="plot the results here (needs matplotlib)")
    p.add_argument("--churn", help="SCHEDULE.json of joins and leaves")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    if args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    placements = parse_list(args.placements, PLACEMENTS, "placement")
    schedulings = parse_list(args.scheduling, SCHEDULINGS, "scheduling")

    started = time.perf_counter()
    cluster = cluster_from_arg(args.cluster)
    events = load_schedule(args.churn, cluster) if args.churn else []
    present = {n.id for n in cluster.nodes} - initially_absent(events)
    start_cluster = present_cluster(cluster, present) if events else cluster
    plans: dict[str, Plan] = {}
    for method in placements:
        t0 = time.perf_counter()
        plans[method] = make_plan(start_cluster, method, args.plan_time_limit_s)
        logger.info(
            "%s: %.1f tokens/s in %.1f s", method, plans[method].max_flow_tokens_s, time.perf_counter() - t0
        )
    # One trace for every row, so rows differ only in placement and scheduling: online load is relative to the
    # best plan's max flow.
    best_flow = max(plan.max_flow_tokens_s for plan in plans.values())
    trace_cfg = TraceConfig()
    config = SimConfig(cache_layer_tokens=args.cache_layer_tokens, decode_quantum_tokens=args.decode_quantum)
    # A request's work in decode tokens at full batch: its output plus its prompt at the prefill discount.
    # Counting output alone would offer 1.33x the work at the same --load (763 prompt tokens at 0.1 each on
    # top of 232), so "75% load" would sit at the edge of capacity, with prefills crowding out decode.
    work = trace_cfg.mean_output_tokens + config.timing.prefill_token_cost * trace_cfg.mean_prompt_tokens
    rate = args.load * best_flow / work if args.mode == "online" else None
    trace = make_trace(args.requests, rate, args.seed, trace_cfg)

    rows: list[dict[str, Any]] = []
    for method in placements:
        for scheduling in schedulings:
            t0 = time.perf_counter()
            sim = Simulation(
                cluster, plans[method], router_factory(cluster, scheduling, args.seed), trace, config
            )
            if events:
                Churn(
                    sim,
                    events,
                    lambda c, cur, m=method: make_plan(c, m, args.plan_time_limit_s, cur),  # type: ignore[misc]
                    present,
                    args.reload_s_per_layer,
                )
            sim.run()
            row = summarize(sim, method, scheduling)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            logger.info(
                "%s/%s: %.1f tokens/s, lost %d, %.1f s wall",
                method,
                scheduling,
                row["decode_tokens_s"],
                row["lost_requests"],
                row["wall_s"],
            )
    result = {
        "cluster": args.cluster,
        "nodes": len(cluster.nodes),
        "mode": args.mode,
        "requests": args.requests,
        "arrival_rate_per_s": rate,
        "seed": args.seed,
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    if args.png:
        plot(rows, args.png)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
