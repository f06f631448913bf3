"""Benchmark the planner against the Petals, SWARM and separate-pipelines heuristics on synthetic clusters.

    python scripts/bench_planner.py [--json OUT] [--time-limit-s 60] [--sizes 8,24,42,64,128] [--quick]

Prints JSON: one row per (cluster, method) with max flow, the best upper bound proven for that cluster and
the solve time, then a per-cluster summary (planner vs. best heuristic, planner vs. bound). Seeds are fixed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from swarm.planner.solve import solve
from swarm.planner.synthetic import benchmark_clusters

HEURISTIC_METHODS = ("greedy", "swarm", "separate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", dest="json_out", help="also write the results here")
    parser.add_argument("--time-limit-s", type=float, default=60.0, help="per cluster, for the milp method")
    parser.add_argument("--sizes", default="8,24,42,64,128", help="comma-separated node counts")
    parser.add_argument("--prune-k", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (8 nodes, 1 s) for CI")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = [8] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    time_limit_s = 1.0 if args.quick else args.time_limit_s
    rows: list[dict[str, object]] = []
    summary: list[dict[str, object]] = []
    for name, cluster in benchmark_clusters(sizes):
        if args.quick and "-r3-" in name:
            continue
        plans = {m: solve(cluster, m, time_limit_s=time_limit_s) for m in HEURISTIC_METHODS}
        plans["milp"] = solve(cluster, "milp", time_limit_s=time_limit_s, seed=0, prune_k=args.prune_k)
        bound = min(p.upper_bound_tokens_s for p in plans.values())
        for method, plan in plans.items():
            rows.append(
                {
                    "cluster": name,
                    "nodes": len(cluster.nodes),
                    "regions": len(cluster.regions),
                    "model": cluster.model.name,
                    "method": method,
                    "max_flow_tokens_s": round(plan.max_flow_tokens_s, 2),
                    "upper_bound_tokens_s": round(bound, 2),
                    "solve_s": round(plan.solve_s, 3),
                }
            )
        best_heuristic = max(plans[m].max_flow_tokens_s for m in HEURISTIC_METHODS)
        milp = plans["milp"]
        phases = {k: round(v, 2) for k, v in milp.extra.items()}
        before_milp = max((v for k, v in milp.extra.items() if k != "milp_tokens_s"), default=0.0)
        summary.append(
            {
                "cluster": name,
                "milp_tokens_s": round(milp.max_flow_tokens_s, 2),
                "best_heuristic_tokens_s": round(best_heuristic, 2),
                "vs_best_heuristic": round(milp.max_flow_tokens_s / best_heuristic, 3)
                if best_heuristic
                else None,
                "fraction_of_bound": round(milp.max_flow_tokens_s / bound, 3) if bound else None,
                "helix_milp_improved": milp.extra.get("milp_tokens_s", 0.0) > before_milp + 1e-6,
                "phases_tokens_s": phases,
                "solve_s": round(milp.solve_s, 1),
                "within_time_limit": milp.solve_s <= time_limit_s,
            }
        )
        print(json.dumps(summary[-1]), file=sys.stderr, flush=True)
    result = {"time_limit_s": time_limit_s, "cpus": os.cpu_count(), "rows": rows, "summary": summary}
    text = json.dumps(result, indent=1)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
