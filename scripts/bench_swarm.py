#!/usr/bin/env python
"""Decode speed through a real local swarm next to local transformers, measured in one run. Prints ONE JSON object.

Starts three `swarm-peer join` processes on 127.0.0.1 (layers split in three), connects a SwarmClient, and
greedily decodes --new-tokens tokens (EOS ignored) after a chat prompt, --repeats times; then does the same
with the plain transformers model in this process, with its own KV cache. Every process runs with one torch
thread. Per run: prefill tok/s = prompt tokens / time to the first new token; decode tok/s = (new tokens - 1)
/ time after it; the best run is reported (the machine is shared and noisy).

    .venv/bin/python scripts/bench_swarm.py                 # default model (SmolLM2-135M)
    .venv/bin/python scripts/bench_swarm.py --model tiny    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from client import SwarmClient  # noqa: E402
from client.generation import GenerationRequest, timed_ids  # noqa: E402
from swarm.models import Sampler, SamplingParams, resolve_model  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402
from swarm.testing.prompts import chat_prompt_ids  # noqa: E402


async def swarm_run(client: SwarmClient, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill_s, decode_s, tokens) of one greedy session through the swarm, by the client's decode loop."""
    request = GenerationRequest(tuple(ids), new_tokens, eos_ids=frozenset())  # EOS ignored, like local_run
    session = client.aclient.new_session(len(ids) + new_tokens)
    try:
        tokens, times = await timed_ids(session, request, Sampler(SamplingParams()).sample)
    finally:
        await session.close()
    return times[1] - times[0], times[-1] - times[1], tokens


def local_run(model: torch.nn.Module, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """The same greedy decode with transformers' own KV cache, in this process."""
    with torch.inference_mode():
        began = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        first = time.perf_counter()
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(new_tokens - 1):
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return first - began, time.perf_counter() - first, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--spot-check-rate",
        type=float,
        default=None,
        help="client spot-check rate (default: the client's own)",
    )
    args = parser.parse_args()
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error("need --new-tokens >= 2 and --repeats >= 1")
    torch.set_num_threads(1)

    source = resolve_model(args.model)
    n = source.spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    ranges = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    ids = chat_prompt_ids(source)
    reference = source.load_reference_model()
    best = {"swarm_prefill": 0.0, "swarm_decode": 0.0, "local_prefill": 0.0, "local_decode": 0.0}
    tokens_match = True
    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-bench-") as tmp,
        LocalSwarm(Path(tmp), model=args.model) as swarm,
    ):
        began = time.perf_counter()
        # --no-follow-plan: the peers keep the three ranges, so every token makes three hops.
        fixed = ["--no-follow-plan"]
        swarm.start_peer(layers=ranges[0], name="peer-a", timeout_s=300, extra_args=fixed)
        for name, layers in zip(("peer-b", "peer-c"), ranges[1:], strict=True):
            swarm.start_peer(layers=layers, name=name, wait=False, extra_args=fixed)
        swarm.wait_all_ready(timeout_s=300)
        swarm_start_s = time.perf_counter() - began
        spot = {} if args.spot_check_rate is None else {"spot_check_rate": args.spot_check_rate}
        with SwarmClient(swarm.initial_peers, model=args.model, **spot) as client:
            # Swarm and local runs alternate, so both see the same (shared, noisy) machine.
            for _ in range(args.repeats):
                runs = {
                    "swarm": client.run(swarm_run(client, ids, args.new_tokens)),
                    "local": local_run(reference, ids, args.new_tokens),
                }
                for name, (prefill_s, decode_s, _tokens) in runs.items():
                    best[f"{name}_prefill"] = max(best[f"{name}_prefill"], len(ids) / prefill_s)
                    best[f"{name}_decode"] = max(best[f"{name}_decode"], (args.new_tokens - 1) / decode_s)
                tokens_match &= runs["swarm"][2] == runs["local"][2]
            session = client.aclient.last_session
            route = [f"{s.layers}" for s in session.stages] if session is not None else []

    report = {
        "model": source.spec.name,
        "peers": len(ranges),
        "route": route,
        "swarm_decode_tok_s": round(best["swarm_decode"], 1),
        "local_decode_tok_s": round(best["local_decode"], 1),
        "swarm_vs_local_decode": round(best["swarm_decode"] / best["local_decode"], 3),
        "swarm_prefill_tok_s": round(best["swarm_prefill"], 1),
        "local_prefill_tok_s": round(best["local_prefill"], 1),
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "tokens_match": tokens_match,
        "swarm_start_s": round(swarm_start_s, 1),
        "threads_per_process": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
