"""Churn benchmark, planner part: each single node of a cluster leaving in turn, before vs. after.

    python scripts/bench_churn.py [--json OUT] [--cluster helix24] [--time-limit-s 5] [--epochs 3]
        [--max-moves 2] [--leaves a100-1,l4-3] [--quick]

before: today's re-solve, swarm.planner.solve(method milp, current = the live placement, reload_cost 0.1),
        from the plan today's planner would have published on the whole cluster.
after:  swarm.planner.replan: the leave is repaired locally (spares, else neighbours), then `--epochs`
        periodic improvements (MILP with a cap of max_moves moved nodes and a price per move), each published
        only above the publish margin, from the plan the new planner publishes on the whole cluster.

Per leave: nodes moved (nodes that held a range and hold another or none) and flow kept = the plan's max flow
/ the best from-scratch max flow on the same 23-node snapshot. Prints JSON; the issue's key
sim.nodes_moved_per_leave {before, after} holds the means over the leaves (after = at the leave, the repair).
Seeds are fixed; time-limited solves still vary a little from run to run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from typing import Any

from swarm.planner.cluster import Cluster
from swarm.planner.graph import max_flow
from swarm.planner.replan import ReplanConfig, from_scratch, moved_nodes, replan
from swarm.planner.solve import solve
from swarm.sim.churn import present_cluster
from swarm.sim.experiment import cluster_from_arg
from swarm.types import LayerRange, NodeID

Placement = dict[NodeID, LayerRange]


def leave_before(cluster: Cluster, start: Placement, limit_s: float) -> tuple[Placement, float]:
    """Today's planner after a leave: a full solve warm-started from the live placement."""
    plan = solve(cluster, "milp", time_limit_s=limit_s, current=start, reload_cost=0.1, seed=0)
    return plan.placement, plan.max_flow_tokens_s


def leave_after(
    cluster: Cluster, start: Placement, config: ReplanConfig, epochs: int
) -> list[tuple[Placement, float, str]]:
    """The new planner after a leave: the published placement after the leave and after each epoch."""
    out: list[tuple[Placement, float, str]] = []
    current = start
    for _ in range(epochs + 1):
        plan, why = replan(cluster, current, config)
        if plan is not None:
            current = plan.placement
        out.append((current, max_flow(cluster, current).max_flow_tokens_s, why))
    return out


def one_leave(
    whole: Cluster, leaver: NodeID, before0: Placement, after0: Placement, args: argparse.Namespace
) -> dict[str, Any]:
    cluster = present_cluster(whole, {n.id for n in whole.nodes} - {leaver})
    best = solve(cluster, "milp", time_limit_s=args.time_limit_s, seed=0).max_flow_tokens_s
    held_b = {n: r for n, r in before0.items() if n != leaver}
    placed_b, flow_b = leave_before(cluster, held_b, args.time_limit_s)
    best = max(best, flow_b)
    config = ReplanConfig(
        time_limit_s=args.time_limit_s, max_moves=args.max_moves, gain_fraction=args.gain_fraction, seed=0
    )
    held_a = {n: r for n, r in after0.items() if n != leaver}
    steps = leave_after(cluster, after0, config, args.epochs)  # the live plan still names the leaver
    best = max([best] + [f for _, f, _ in steps])
    return {
        "leaver": leaver,
        "best_tokens_s": best,
        "before": {"moved": len(moved_nodes(held_b, placed_b)), "flow_kept": flow_b / best},
        "after": [
            {"moved": len(moved_nodes(held_a, p)), "flow_kept": f / best, "why": why} for p, f, why in steps
        ],
    }


def summary(rows: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    mean = statistics.fmean
    return {
        "nodes_moved_per_leave": {
            "before": mean(r["before"]["moved"] for r in rows),
            "after": mean(r["after"][0]["moved"] for r in rows),
        },
        "flow_kept_per_leave": {
            "before": mean(r["before"]["flow_kept"] for r in rows),
            "after": mean(r["after"][0]["flow_kept"] for r in rows),
        },
        "after_epochs": [
            {
                "epoch": e,
                "nodes_moved_total": mean(r["after"][e]["moved"] for r in rows),
                "flow_kept": mean(r["after"][e]["flow_kept"] for r in rows),
                "min_flow_kept": min(r["after"][e]["flow_kept"] for r in rows),
            }
            for e in range(epochs + 1)
        ],
        "before_min_flow_kept": min(r["before"]["flow_kept"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", dest="json_out", help="also write the results here")
    parser.add_argument("--cluster", default="helix24", help="helix24 / helix42 / randomN / CLUSTER.json")
    parser.add_argument("--time-limit-s", type=float, default=5.0, help="per solve")
    parser.add_argument("--epochs", type=int, default=3, help="periodic improvements after each leave")
    parser.add_argument("--max-moves", type=int, default=ReplanConfig.max_moves)
    parser.add_argument("--gain-fraction", type=float, default=ReplanConfig.gain_fraction)
    parser.add_argument("--leaves", default="", help="comma-separated node ids (default: every node)")
    parser.add_argument("--quick", action="store_true", help="smoke run: two leaves, 1 s solves, 1 epoch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.time_limit_s, args.epochs, args.leaves = 1.0, 1, args.leaves or "a100-1,t4-5"
    whole = cluster_from_arg(args.cluster)
    before0 = solve(whole, "milp", time_limit_s=args.time_limit_s, seed=0).placement
    after0 = from_scratch(whole, None, ReplanConfig(time_limit_s=args.time_limit_s, seed=0)).placement
    leavers = [NodeID(x) for x in args.leaves.split(",") if x] or [n.id for n in whole.nodes]
    rows = []
    for leaver in leavers:
        rows.append(one_leave(whole, leaver, before0, after0, args))
        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {
        "cluster": args.cluster,
        "time_limit_s": args.time_limit_s,
        "max_moves": args.max_moves,
        "initial_tokens_s": {
            "before": max_flow(whole, before0).max_flow_tokens_s,
            "after": max_flow(whole, after0).max_flow_tokens_s,
        },
        "sim": summary(rows, args.epochs),
        "per_leave": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
