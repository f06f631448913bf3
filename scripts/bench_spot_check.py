#!/usr/bin/env python
"""What spot-checks cost and what they buy. Prints ONE JSON object.

Cost: starts two `swarm-peer join` processes on 127.0.0.1 that both hold every layer (so every step can be
checked, and a check re-runs the whole model on both: the most a check can cost relative to a step), or with
--hops N two holders of each of N equal stages (routes of N hops, so the route check runs too), connects
one SwarmClient and greedily decodes --new-tokens tokens (EOS ignored) at each spot-check rate of --rates,
interleaved, --repeats times, with each check blocking its step (what a check costs) and then running beside the
next steps (the default, what the user sees). Decode tok/s = (new tokens - 1) / time after the first token; the
median and best run per rate are reported, with the overhead against rate 0 and whether the tokens equal those
of rate 0.

Benefit: in-process (client.local, tiny model), a peer that corrupts every output sits on the route next to an
honest holder of the same layers; over --liar-trials seeded trials at --liar-rate, how many steps it serves
before the client stops routing to it.

    .venv/bin/python scripts/bench_spot_check.py                       # default model (SmolLM2-135M)
    .venv/bin/python scripts/bench_spot_check.py --model tiny --new-tokens 8 --repeats 1 --liar-trials 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from client import ClientConfig, SwarmClient  # noqa: E402
from client.generation import GenerationRequest, timed_ids  # noqa: E402
from client.local import in_process_client  # noqa: E402
from swarm.models import ModelSource, Sampler, SamplingParams, resolve_model  # noqa: E402
from swarm.models.faults import OutputFaults  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402
from swarm.testing.prompts import chat_prompt_ids  # noqa: E402
from swarm.types import NodeID  # noqa: E402


async def decode_run(client: SwarmClient, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """(decode tok/s, tokens) of one greedy session, by the client's own decode loop."""
    request = GenerationRequest(tuple(ids), new_tokens, eos_ids=frozenset())
    session = client.aclient.new_session(len(ids) + new_tokens)
    try:
        tokens, times = await timed_ids(session, request, Sampler(SamplingParams()).sample)
    finally:
        await session.close()
    return (new_tokens - 1) / (times[-1] - times[1]), tokens


def measure_cost(source: ModelSource, model: str, rates: list[float], args: argparse.Namespace) -> dict:
    ids = chat_prompt_ids(source)
    n, hops = source.spec.num_layers, args.hops
    stages = [f"{n * i // hops}:{n * (i + 1) // hops}" for i in range(hops)]
    speeds: dict[float, list[float]] = {r: [] for r in rates}  # checks blocking their step: a check's cost
    background: dict[float, list[float]] = {r: [] for r in rates}  # the default: checks beside the steps
    checks: dict[float, int] = dict.fromkeys(rates, 0)
    same_tokens = True
    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-bench-") as tmp,
        LocalSwarm(Path(tmp), model=model) as swarm,
    ):
        fixed = ["--no-follow-plan"]
        swarm.start_peer(layers=stages[0], name="peer-a0", timeout_s=300, extra_args=fixed)
        for i, layers in enumerate(stages):
            for holder in "ab"[1 if i == 0 else 0 :]:
                swarm.start_peer(layers=layers, name=f"peer-{holder}{i}", wait=False, extra_args=fixed)
        swarm.wait_all_ready(timeout_s=300)
        with SwarmClient(swarm.initial_peers, model=model, spot_check_seed=args.seed) as client:
            checker = client.aclient.checker
            for _ in range(args.repeats):
                baseline: list[int] | None = None
                for rate in rates:  # interleaved, so every rate sees the same (shared, noisy) machine
                    checker.rate, checker.blocking, before = rate, True, checker.checks_run
                    speed, tokens = client.run(decode_run(client, ids, args.new_tokens))
                    speeds[rate].append(speed)
                    checks[rate] += checker.checks_run - before
                    checker.blocking = False
                    speed, beside = client.run(decode_run(client, ids, args.new_tokens))
                    background[rate].append(speed)
                    baseline = tokens if baseline is None else baseline
                    same_tokens &= tokens == baseline == beside
    base = statistics.median(speeds[rates[0]])
    # What one check costs, in decode steps, from the highest rate (where checks dominate the noise); the
    # overhead at the default rate r follows as r * cost / (1 + r * cost) of decode tok/s.
    top = rates[-1]
    checks_per_step = checks[top] / args.repeats / args.new_tokens
    cost_steps = (base / statistics.median(speeds[top]) - 1) / checks_per_step if checks_per_step else 0.0
    default_rate = ClientConfig().spot_check_rate
    return {
        "peers": 2 * hops,
        "route": stages,
        "prompt_tokens": len(ids),
        "per_rate": {
            str(rate): {
                "decode_tok_s_median": round(statistics.median(speeds[rate]), 2),
                "decode_tok_s_best": round(max(speeds[rate]), 2),
                "overhead_median": round(1 - statistics.median(speeds[rate]) / base, 3),
                "checks_per_run": round(checks[rate] / args.repeats, 1),
                # the default (ClientConfig.spot_check_blocking False): checks run beside the next steps
                "background_decode_tok_s_median": round(statistics.median(background[rate]), 2),
                "background_overhead_median": round(
                    1 - statistics.median(background[rate]) / statistics.median(background[rates[0]]), 3
                ),
            }
            for rate in rates
        },
        "tokens_equal_across_rates": same_tokens,
        "check_cost_decode_steps": round(cost_steps, 2),
        "predicted_overhead_at_default_rate": round(
            default_rate * cost_steps / (1 + default_rate * cost_steps), 3
        ),
    }


def steps_a_liar_serves(rate: float, trials: int, seed: int) -> dict:
    """Steps served by a peer that corrupts every output, until the client excludes it (in-process, tiny)."""
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    head = source.load_head()
    ids = [(7 * i + 3) % source.spec.vocab_size for i in range(8)]
    served = []
    for trial in range(trials):
        # the router breaks this tie by name, so "a-liar" is on the route and "b-honest" checks it
        names = ("a-liar", "b-honest")
        blocks = {p: source.load_blocks(0, source.spec.num_layers, cache_tokens=4096) for p in names}
        config = ClientConfig(retry_delay_s=0.0, spot_check_rate=rate, spot_check_seed=seed + trial)
        client = in_process_client(head, blocks, None, config)
        liar = NodeID("a-liar")
        client.chain.faulty[liar] = OutputFaults(1.0, seed + trial)  # type: ignore[attr-defined]
        while not client.checker.excluded:
            asyncio.run(client.generate_ids(ids, 32, SamplingParams()))
        served.append(client.checker.steps_served[liar])
    return {
        "liar_rate": rate,
        "trials": trials,
        "steps_served_mean": round(statistics.mean(served), 1),
        "steps_served_median": statistics.median(served),
        "steps_served_max": max(served),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rates", default=f"0,{ClientConfig().spot_check_rate},1", help="comma-separated")
    parser.add_argument("--hops", type=int, default=1, help="stages per route (two holders each)")
    parser.add_argument("--liar-rate", type=float, default=ClientConfig().spot_check_rate)
    parser.add_argument("--liar-trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if args.new_tokens < 2 or args.repeats < 1 or rates[0] != 0 or args.hops < 1:
        parser.error("need --new-tokens >= 2, --repeats >= 1, --hops >= 1 and --rates starting with 0")
    random.seed(args.seed)
    torch.set_num_threads(1)
    began = time.perf_counter()
    source = resolve_model(args.model)
    report = {
        "model": source.spec.name,
        "default_spot_check_rate": ClientConfig().spot_check_rate,
        "spot_check_tokens": ClientConfig().spot_check_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **measure_cost(source, args.model, rates, args),
        "liar": steps_a_liar_serves(args.liar_rate, args.liar_trials, args.seed),
        "threads_per_process": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "elapsed_s": round(time.perf_counter() - began, 1),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
