"""CLI: python -m swarm.planner solve CLUSTER.json [...] | evaluate CLUSTER.json PLACEMENT.json [...]."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from swarm.errors import PlanningError
from swarm.planner.cluster import load_cluster
from swarm.planner.graph import max_flow
from swarm.planner.milp import TIME_LIMIT_S
from swarm.planner.placement import placement_problems
from swarm.planner.solve import METHODS, solve
from swarm.types import Plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.planner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_solve = sub.add_parser("solve", help="plan a placement for a cluster")
    p_solve.add_argument("cluster", help="CLUSTER.json")
    p_solve.add_argument("--method", choices=METHODS, default="milp")
    p_solve.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S)
    p_solve.add_argument("--seed", type=int, default=0)
    p_solve.add_argument("--prune-k", type=int, default=8, help="hop links kept per node in the MILP")
    p_solve.add_argument("--json", dest="json_out", help="write the plan here (default: stdout)")
    p_eval = sub.add_parser("evaluate", help="max flow of a given placement")
    p_eval.add_argument("cluster", help="CLUSTER.json")
    p_eval.add_argument("placement", help="PLACEMENT.json (a plan; only its placement is read)")
    p_eval.add_argument("--json", dest="json_out", help="write the evaluated plan here (default: stdout)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cluster = load_cluster(args.cluster)
        if args.command == "solve":
            plan = solve(
                cluster, args.method, time_limit_s=args.time_limit_s, seed=args.seed, prune_k=args.prune_k
            )
        else:
            with open(args.placement) as f:
                placement = Plan.from_json(json.load(f)).placement
            problems = placement_problems(cluster, placement)
            if problems:
                raise PlanningError("invalid placement: " + "; ".join(problems))
            plan = max_flow(cluster, placement)
    except (OSError, ValueError, KeyError, PlanningError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(plan.to_json(), indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
