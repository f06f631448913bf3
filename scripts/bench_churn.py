"""Churn benchmark, in three parts: the planner (each single node of a cluster leaving in turn, before vs. after),
the simulator (the helix24 churn trace, the swarm before issue 13 and now), and real peers on 127.0.0.1 while
clients generate, one SIGTERMed and one SIGKILLed, each restarted.

    python scripts/bench_churn.py [--json OUT] [--png PLOT] [--quick] [--cluster helix24] [--time-limit-s 5]
        [--epochs 3] [--max-moves 2] [--leaves a100-1,l4-3] [--requests 3000] [--no-sim] [--no-real]
        [--model default] [--seed 0]

Prints {"sim": {"nodes_moved_per_leave": {before, after}, "min_window_ratio", "failovers_per_leave",
"sessions_on_leaving_node", "restarts", "lost", ...}, "real": {"requests", "failed", "exact", "max_gap_healthy_s",
"pause_s": {graceful, kill}, "tokens_replayed": {graceful, kill}, ...}}. --quick: 2 leaves with 1 s solves, 300
simulated requests, the tiny model on the real part (the CI smoke run adds --no-real: the churn test covers it).

before: today's re-solve, swarm.planner.solve(method milp, current = the live placement, reload_cost 0.1),
        from the plan today's planner would have published on the whole cluster.
after:  swarm.planner.replan: the leave is repaired locally (spares, else neighbours), then `--epochs`
        periodic improvements (MILP with a cap of max_moves moved nodes and a price per move), each published
        only above the publish margin, from the plan the new planner publishes on the whole cluster.

Simulator part (swarm.sim, --requests on helix24 with the bundled churn_helix24 trace, churn modes old and
new on the same plans; --png plots both over time): min_window_ratio = the lowest 30 s window after a leave over
the same window of a churn-free run on the nodes that remain; failovers (replays) and KV hand-overs per leave;
restarts; lost. See swarm/sim/report.py.

Planner part, per leave: nodes moved (nodes that held a range and hold another or none) and flow kept = the plan's max flow
/ the best from-scratch max flow on the same 23-node snapshot. Prints JSON; the issue's key
sim.nodes_moved_per_leave {before, after} holds the means over the leaves (after = at the leave, the repair).
Seeds are fixed; time-limited solves still vary a little from run to run.

Real part (swarm.testing.churn, the scenario of tests/integration/test_churn_real.py, run longer): 5 peers of
--model (default: SmolLM2-135M, each held to 12 layers or fewer: 0:12 12:24 18:30 6:18 0:12, nobody following
the plan), --clients clients each asking greedy --new-tokens answers in a loop, one peer SIGTERMed and one
SIGKILLed (drawn from a client's live route) and each restarted, all at seeded points of the clients' progress;
the SIGKILL comes once the SIGTERMed peer serves again.
Prints "real": requests, failed, exact, max_gap_healthy_s, pause_s {graceful, kill} (the largest gap between a
client's consecutive tokens from the leave to the next event; max_gap_healthy_s: before the first event, while
the elected peer's planner solves), tokens_replayed {graceful, kill}, failovers, max_ttft_s (the longest wait
for a first token, which is not a gap between tokens), and per event the same figures plus the peers' RSS. With --quick: the tiny model (6 layers, 0:3 0:3 3:6 3:6 0:6), 10 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarm.planner.cluster import Cluster
from swarm.planner.graph import max_flow
from swarm.planner.replan import ReplanConfig, from_scratch, moved_nodes, replan
from swarm.planner.solve import solve
from swarm.sim.churn import present_cluster
from swarm.sim.experiment import Experiment, cluster_from_arg, run_experiment
from swarm.sim.report import plot_churn
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


REAL_LAYOUTS = {
    "default": ("0:12", "12:24", "18:30", "6:18", "0:12"),
    "tiny": ("0:3", "0:3", "3:6", "3:6", "0:6"),
}
REAL_PEER_ARGS = ("--no-follow-plan", "--record-ttl-s", "6", "--shutdown-grace-s", "5")


def real_prompts(model: str, count: int) -> tuple[tuple[int, ...], ...]:
    """`count` chat prompts of the model's own template (fixed ids for the tiny model, which has none)."""
    from swarm.models import resolve_model
    from swarm.testing.prompts import chat_prompt_ids

    source = resolve_model(model)
    if source.tokenizer() is None:
        rng = random.Random(13)
        return tuple(tuple(rng.randrange(1, 256) for _ in range(6 + i)) for i in range(count))
    topics = ["Paris", "the Moon", "bread", "rivers", "chess", "volcanoes", "music", "bees"]
    questions = [f"Tell me about {topics[i % len(topics)]} in a few sentences." for i in range(count)]
    return tuple(tuple(chat_prompt_ids(source, q)) for q in questions)


def answerer(clients: list[Any], new_tokens: int) -> Any:
    """One greedy request (EOS ignored: the reference does not stop either) on client number c."""
    from client.generation import GenerationRequest, generate_ids
    from swarm.models.head import Sampler, SamplingParams
    from swarm.testing.churn import Answer, OnToken

    async def answer(c: int, prompt: Sequence[int], on_token: OnToken) -> Answer:
        session = clients[c].new_session(len(prompt) + new_tokens)
        request = GenerationRequest(tuple(prompt), new_tokens, frozenset())
        tokens: list[int] = []
        try:
            async for token in generate_ids(session, request, Sampler(SamplingParams()).sample):
                tokens.append(token)
                on_token([str(s.peer_id) for s in session.stages])
        finally:
            await session.close()
        log = [(f.at_s, f"{f.error}/{f.detected_by}/{f.action.name}") for f in session.failover_log]
        return Answer(tokens, session.replayed_tokens, log)

    return answer


async def real_churn(swarm: Any, model: str, config: Any, new_tokens: int) -> Any:
    from client import AsyncSwarmClient
    from client.config import ClientConfig
    from swarm.testing.churn import ChurnRun

    clients: list[Any] = []
    client_config = ClientConfig(spot_check_rate=0.0, route_wait_s=300.0)
    try:
        for _ in range(config.clients):
            clients.append(await AsyncSwarmClient.create(swarm.initial_peers, model, client_config))
        run = ChurnRun(swarm, config, answerer(clients, new_tokens))
        await run.run()
        return run
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def run_real(args: argparse.Namespace) -> dict[str, Any]:
    """The real part: start the peers, run the scenario, and sum it up as the issue's "real" figures."""
    from swarm.models import resolve_model
    from swarm.testing import LocalSwarm, greedy_tokens
    from swarm.testing.churn import ChurnConfig

    os.environ["FLOWSWARM_THREADS"] = "1"
    layouts = REAL_LAYOUTS["tiny" if args.model.startswith("tiny") else "default"]
    prompts = real_prompts(args.model, args.clients)
    reference = resolve_model(args.model).load_reference_model()
    expected = [greedy_tokens(reference, p, args.new_tokens) for p in prompts]
    del reference
    config = ChurnConfig(
        layouts,
        prompts,
        args.new_tokens,
        clients=args.clients,
        seed=args.seed,
        tokens_between_events=(args.new_tokens, 3 * args.new_tokens),
        requests_after=args.requests_after,
        peer_args=REAL_PEER_ARGS,
        think_s=args.think_s,
        kill_after_return=True,  # as the run: SIGTERM, restart, then SIGKILL
        ready_timeout_s=600.0,
        progress_timeout_s=600.0,
    )
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), model=args.model) as swarm:
        swarm.start_peer(layouts[0], name="p0", extra_args=REAL_PEER_ARGS, timeout_s=600)
        for i, layout in enumerate(layouts[1:], 1):
            swarm.start_peer(layout, name=f"p{i}", extra_args=REAL_PEER_ARGS, wait=False)
        swarm.wait_all_ready(timeout_s=600)
        run = asyncio.run(real_churn(swarm, args.model, config, args.new_tokens))
        figures = run.figures(expected)
    for event in figures["events"]:
        print(json.dumps(event), file=sys.stderr)
    by_kind = {e["kind"]: e for e in figures["events"]}
    return {
        "model": args.model,
        "clients": args.clients,
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "think_s": args.think_s,
        "requests": figures["requests"],
        "failed": figures["failed"],
        "exact": figures["exact"],
        "max_gap_healthy_s": figures["max_gap_healthy_s"],
        "pause_s": {"graceful": by_kind["sigterm"]["max_gap_s"], "kill": by_kind["sigkill"]["max_gap_s"]},
        "tokens_replayed": {
            "graceful": by_kind["sigterm"]["tokens_replayed"],
            "kill": by_kind["sigkill"]["tokens_replayed"],
        },
        "failovers": {"graceful": by_kind["sigterm"]["failovers"], "kill": by_kind["sigkill"]["failovers"]},
        # a request's wait for its first token is not a gap between tokens: the longest such wait, apart
        "max_ttft_s": {
            "healthy": figures["max_ttft_healthy_s"],
            "graceful": by_kind["sigterm"]["max_ttft_s"],
            "kill": by_kind["sigkill"]["max_ttft_s"],
        },
        "details": figures,
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
    parser.add_argument("--png", help="plot the simulated churn run's throughput over time, old vs new, here")
    parser.add_argument(
        "--requests", type=int, default=3000, help="simulated churn run: requests (--quick 300)"
    )
    parser.add_argument("--no-real", action="store_true", help="skip the real part (peers on 127.0.0.1)")
    parser.add_argument("--no-sim", action="store_true", help="skip the planner and simulator parts")
    parser.add_argument(
        "--model", default="default", help="real part: default | tiny[:SEED] (--quick: tiny:0)"
    )
    parser.add_argument("--clients", type=int, default=4, help="real part: concurrent clients")
    parser.add_argument("--new-tokens", type=int, default=64, help="real part: tokens per answer")
    parser.add_argument(
        "--requests-after", type=int, default=2, help="real part: per client, after the last event"
    )
    parser.add_argument("--seed", type=int, default=0, help="real part: which client, when, and which peer")
    parser.add_argument(
        "--think-s", type=float, default=0.0, help="real part: a client's pause between answers"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.time_limit_s, args.epochs, args.leaves = 1.0, 1, args.leaves or "a100-1,t4-5"
        args.model, args.new_tokens, args.requests_after = "tiny:0", 10, 1
        args.requests = min(args.requests, 300)
    result: dict[str, Any] = {} if args.no_sim else run_sim(args)
    if not args.no_sim:
        result["sim"] |= run_sim_churn(args)
    if not args.no_real:
        result["real"] = run_real(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    whole = cluster_from_arg(args.cluster)
    before0 = solve(whole, "milp", time_limit_s=args.time_limit_s, seed=0).placement
    after0 = from_scratch(whole, None, ReplanConfig(time_limit_s=args.time_limit_s, seed=0)).placement
    leavers = [NodeID(x) for x in args.leaves.split(",") if x] or [n.id for n in whole.nodes]
    rows = []
    for leaver in leavers:
        rows.append(one_leave(whole, leaver, before0, after0, args))
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {
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


def run_sim_churn(args: argparse.Namespace) -> dict[str, Any]:
    """The simulator's helix24 churn trace, the swarm before issue 13 ("old") and now ("new"), same plans: the
    issue's sim figures (new), the same figures of old, and the throughput-over-time plot (--png)."""
    experiment = Experiment(
        cluster="helix24",
        mode="online",
        requests=args.requests,
        placements=("milp",),
        schedulings=("iwrr",),
        plan_time_limit_s=args.time_limit_s,
        churn="churn_helix24",
        churn_mode="both",
    )
    result = run_experiment(experiment)
    if args.png:
        plot_churn(result, args.png)
    targets = {t["churn_mode"]: t for t in result["churn_targets"]}
    keys = ("min_window_ratio", "failovers_per_leave", "sessions_on_leaving_node", "restarts", "lost")
    return {
        **{k: targets["new"][k] for k in keys},
        "handovers_per_leave": targets["new"]["handovers_per_leave"],
        "met": targets["new"]["met"],
        "old": {k: targets["old"][k] for k in keys},
        "sim_requests": args.requests,
    }


if __name__ == "__main__":
    sys.exit(main())
