#!/usr/bin/env python3
"""Simulate serving on a cluster: placements x schedulings, online or offline, optionally with churn.

    scripts/simulate.py CLUSTER.json [--mode online|offline] [--requests N]
        [--placements milp,greedy,swarm,separate] [--scheduling iwrr,random,swarm] [--seed S]
        [--json OUT] [--png PLOT] [--churn SCHEDULE.json | --churn churn_helix24] [--replan local|scratch]
        [--churn-mode new|old|both] [--churn-features mbb,partial,handover,chunked] [--no-reference]
    scripts/simulate.py twoclass --split-phases [--requests N] [--load F] [--prompt-chunk-tokens T]

CLUSTER.json is the planner's format (swarm/planner/cluster.py), optionally with measured timing tables per
node (swarm/sim/timing.py) and "cache_tokens"; "helix24", "helix42" or "randomN" name synthetic clusters.
Prints {"rows": [...]} as JSON (one row per placement x scheduling). The simulator is swarm/sim.
"twoclass" (or "twoclassPxD") names a cluster of P prefill-strong and D memory-strong cards
(swarm/planner/two_class.py). --split-phases compares prefill and decode on separate routes against single
routes instead (swarm/sim/split_phases.py), printing sim_throughput_ratio and sim_ttft_p90_ratio among others.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from swarm.sim.experiment import (
    CHURN_MODES,
    PLACEMENTS,
    SCHEDULINGS,
    Experiment,
    cluster_from_arg,
    run_experiment,
)
from swarm.sim.report import plot, plot_churn
from swarm.sim.split_phases import PhaseComparison, compare_phases


def split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", help="CLUSTER.json, or helix24 / helix42 / randomN for a synthetic cluster")
    p.add_argument("--mode", choices=("online", "offline"), default=Experiment.mode)
    p.add_argument("--requests", type=int, default=Experiment.requests)
    p.add_argument(
        "--placements",
        default=",".join(Experiment.placements),
        help=f"comma-separated: {','.join(PLACEMENTS)}",
    )
    p.add_argument(
        "--scheduling",
        default=",".join(Experiment.schedulings),
        help=f"comma-separated: {','.join(SCHEDULINGS)}",
    )
    p.add_argument("--seed", type=int, default=Experiment.seed)
    p.add_argument(
        "--load",
        type=float,
        default=Experiment.load,
        help="online arrival rate as a fraction of max flow (a prompt token counts as prefill_token_cost of "
        "a decode token)",
    )
    p.add_argument(
        "--plan-time-limit-s",
        type=float,
        default=Experiment.plan_time_limit_s,
        help="MILP / search time limit",
    )
    p.add_argument(
        "--reload-s-per-layer",
        type=float,
        default=Experiment.reload_s_per_layer,
        help="churn: time to load one layer",
    )
    p.add_argument(
        "--cache-layer-tokens",
        type=int,
        default=Experiment.cache_layer_tokens,
        help="KV cache of nodes without cache_tokens, in tokens x layers (split over the layers they hold)",
    )
    p.add_argument(
        "--decode-quantum",
        type=int,
        default=Experiment.decode_quantum_tokens,
        help="decode tokens per simulated pass (1 = exact; larger is faster and coarser, for huge runs)",
    )
    p.add_argument("--json", dest="json_out", help="write the result JSON here too")
    p.add_argument("--png", help="plot the results here (needs matplotlib)")
    p.add_argument(
        "--churn", help="SCHEDULE.json of joins and leaves, or a bundled one by name (churn_helix24)"
    )
    p.add_argument(
        "--replan",
        choices=("local", "scratch"),
        default=Experiment.replan,
        help="churn: repair then a capped improvement (the live planner), or a full re-solve (before)",
    )
    p.add_argument(
        "--churn-mode",
        choices=CHURN_MODES,
        default=Experiment.churn_mode,
        help="churn: issue 13's behaviour (new: --churn-features on), the swarm before it (old), or a row of each "
        "(both; the --png then plots both over time)",
    )
    p.add_argument(
        "--churn-features",
        default=",".join(Experiment.churn_features),
        help="churn: which behaviours 'new' turns on: mbb (make before break), partial (partial replay), "
        "handover (KV hand-over), chunked (chunked replay prefill)",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="churn: skip the churn-free runs on the nodes that remain (no window ratios)",
    )
    p.add_argument(
        "--split-phases",
        action="store_true",
        help="compare split prefill/decode routes against single routes (throughput, TTFT, time between tokens)",
    )
    p.add_argument(
        "--prompt-chunk-tokens",
        type=int,
        default=PhaseComparison.prompt_chunk_tokens,
        help="split phases: prompt tokens an iteration takes in next to decode (0: whole prompts)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    if args.split_phases:
        return split_phases(args)
    try:
        experiment = Experiment(
            cluster=args.cluster,
            mode=args.mode,
            requests=args.requests,
            placements=split(args.placements),
            schedulings=split(args.scheduling),
            seed=args.seed,
            load=args.load,
            plan_time_limit_s=args.plan_time_limit_s,
            reload_s_per_layer=args.reload_s_per_layer,
            cache_layer_tokens=args.cache_layer_tokens,
            decode_quantum_tokens=args.decode_quantum,
            churn=args.churn,
            replan=args.replan,
            churn_mode=args.churn_mode,
            churn_features=split(args.churn_features),
            reference=not args.no_reference,
        )
    except ValueError as e:  # bad placement / scheduling names, --requests < 1, no such churn schedule
        raise SystemExit(str(e)) from None
    result = run_experiment(experiment)
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    if args.png:
        if "churn_targets" in result or result.get("replan"):
            plot_churn(result, args.png)
        else:
            plot(result["rows"], args.png)
    print(text)
    return 0


def split_phases(args: argparse.Namespace) -> int:
    """--split-phases: split against single routes on the cluster, as JSON."""
    if args.requests < 1:
        raise SystemExit(f"--requests must be >= 1, got {args.requests}")
    try:
        cluster = cluster_from_arg(args.cluster)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from None
    comparison = PhaseComparison(
        requests=args.requests,
        seed=args.seed,
        load=args.load,
        plan_time_limit_s=args.plan_time_limit_s,
        decode_quantum_tokens=args.decode_quantum,
        prompt_chunk_tokens=args.prompt_chunk_tokens,
    )
    result = {"cluster": args.cluster, "requests": args.requests, "seed": args.seed}
    result |= compare_phases(cluster, comparison)
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
