#!/usr/bin/env python
"""Long-prompt prefill through a real local swarm: time to first token next to local transformers, and the
inter-token latency of running decodes while a long prompt is prefilled. Prints ONE JSON object.

Starts three `swarm-peer join` processes on 127.0.0.1 (layers split in three, kept fixed), every process with
one torch thread. Reports, for a --tokens prompt (random ids, fixed seed): local and swarm TTFT (best of
--repeats, plus the median), whether the swarm's first token equals transformers'; then the per-token latency
of --sessions sessions decoding together, alone (p50) and while a --tokens prompt is prefilled (p50, p99).

    .venv/bin/python scripts/bench_prefill.py                      # default model, 2048 tokens
    .venv/bin/python scripts/bench_prefill.py --model tiny --tokens 64 --repeats 1   # smoke run

TTFT is measured three ways in turn, each --repeats times: local transformers, the swarm with the prompt sent
whole (hop by hop, as before pipelining), and the swarm with the prompt pipelined in --client-chunk-tokens chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from client import SwarmClient  # noqa: E402
from client.client import AsyncSwarmClient  # noqa: E402
from swarm.models import resolve_model  # noqa: E402
from swarm.models.blocks import Step  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402


async def swarm_ttft(
    client: AsyncSwarmClient, ids: list[int], chunk_tokens: int | None = None
) -> tuple[float, int]:
    """Seconds to the first token, and that token; ``chunk_tokens`` overrides the client's pipelining."""
    session = client.new_session(len(ids) + 1)
    if chunk_tokens is not None:
        session.prefill_chunk_tokens = chunk_tokens
    try:
        began = time.perf_counter()
        logits = await session.forward(ids)
        return time.perf_counter() - began, int(logits.argmax())
    finally:
        await session.close()


def local_ttft(model: torch.nn.Module, ids: list[int]) -> tuple[float, int]:
    with torch.inference_mode():
        began = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        return time.perf_counter() - began, int(out.logits[0, -1].argmax())


async def decode_gaps(
    client: AsyncSwarmClient, sessions: int, tokens: int, stop: asyncio.Event
) -> list[float]:
    """Seconds between consecutive tokens of ``sessions`` greedy decodes running together."""

    async def one(seed: int) -> list[float]:
        session = client.new_session(16 + min(tokens, 256))
        gaps: list[float] = []
        try:
            logits = await session.forward([1 + seed, 2 + seed, 3 + seed])
            last = time.perf_counter()
            for _ in range(tokens):
                if stop.is_set():
                    break
                logits = await session.forward([int(logits.argmax())])
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
        finally:
            await session.close()
        return gaps

    results = await asyncio.gather(*(one(i) for i in range(sessions)))
    return [gap for gaps in results for gap in gaps]


async def decode_during_prefill(client: AsyncSwarmClient, ids: list[int], sessions: int) -> dict[str, float]:
    alone = await decode_gaps(client, sessions, 24, asyncio.Event())
    stop = asyncio.Event()
    decoding = asyncio.create_task(decode_gaps(client, sessions, 200, stop))
    await asyncio.sleep(1.0)  # the decodes are running
    began = time.perf_counter()
    await swarm_ttft(client, ids)
    prefill_s = time.perf_counter() - began
    stop.set()
    gaps = await decoding
    # the gaps that ended while the prompt was prefilled: the last ~prefill_s worth of each session's gaps
    during = _last_seconds(gaps, sessions, prefill_s)
    q = statistics.quantiles(during, n=100)
    return {
        "p50_alone_ms": round(1000 * statistics.median(alone), 1),
        "p50_ms": round(1000 * statistics.median(during), 1),
        "p99_ms": round(1000 * q[98], 1),
        "max_ms": round(1000 * max(during), 1),
        "prefill_s": round(prefill_s, 3),
        "gaps_during": len(during),
    }


def _last_seconds(gaps: list[float], sessions: int, seconds: float) -> list[float]:
    per = len(gaps) // sessions
    out: list[float] = []
    for i in range(sessions):
        mine, total = gaps[i * per : (i + 1) * per], 0.0
        for gap in reversed(mine):
            if total > seconds:
                break
            out.append(gap)
            total += gap
    return out


def chunk_costs(model: str, tokens: int, chunk: int, repeats: int) -> dict[str, object]:
    """Seconds per token of a ``chunk``-token prefill chunk at each position of a ``tokens`` prompt, on one
    third of the model's layers in this process (one thread), and the position where a token's attention
    costs as much as the rest of its layer (client.session.ATTENTION_COST_TOKENS): a straight-line fit."""
    source = resolve_model(model)
    blocks = source.load_blocks(0, source.spec.num_layers // 3, cache_tokens=tokens)
    hidden = torch.randn(tokens, source.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    best = [float("inf")] * (tokens // chunk)
    for _ in range(repeats):
        blocks.open_session("s", tokens)
        for i in range(tokens // chunk):
            step = Step(
                "s", hidden[i * chunk : (i + 1) * chunk], blocks.range.start, blocks.range.end, i * chunk
            )
            began = time.perf_counter()
            blocks.forward([step])
            best[i] = min(best[i], (time.perf_counter() - began) / chunk)
        blocks.close_session("s")
    middles = [i * chunk + chunk / 2 for i in range(len(best))]
    slope = statistics.linear_regression(middles, best).slope
    intercept = statistics.linear_regression(middles, best).intercept
    return {
        "chunk": chunk,
        "ms_per_token": [round(1000 * b, 4) for b in best],
        "attention_cost_tokens": round(intercept / slope),
    }


def ttft_report(
    client: SwarmClient, reference: torch.nn.Module, prompt: list[int], repeats: int, chunk_tokens: int
) -> dict[str, object]:
    """TTFT local, swarm with the prompt whole, swarm pipelined: ``repeats`` rounds, the three in turn."""
    report: dict[str, object] = {}
    modes = {"local": None, "swarm_whole": 0, "swarm_pipelined": chunk_tokens}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    match = True
    for _ in range(repeats):  # alternate, so all see the same (shared, noisy) machine
        local_s, local_token = local_ttft(reference, prompt)
        times["local"].append(local_s)
        for mode in ("swarm_whole", "swarm_pipelined"):
            swarm_s, swarm_token = client.run(swarm_ttft(client.aclient, prompt, modes[mode]))
            times[mode].append(swarm_s)
            match &= local_token == swarm_token
    report["ttft_s"] = {mode: [round(t, 3) for t in ts] for mode, ts in times.items()}
    for mode in ("swarm_whole", "swarm_pipelined"):
        report[f"{mode}_vs_local_best"] = round(min(times[mode]) / min(times["local"]), 3)
        report[f"{mode}_vs_local_median"] = round(
            statistics.median(times[mode]) / statistics.median(times["local"]), 3
        )
    report["first_token_match"] = match
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--client-chunk-tokens", type=int, default=256, help="pipelined chunk size")
    parser.add_argument("--peer-args", default="", help="extra swarm-peer join arguments")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--chunk-costs", action="store_true", help="only time chunks in this process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.chunk_costs:
        print(json.dumps(chunk_costs(args.model, args.tokens, args.client_chunk_tokens, args.repeats)))
        return
    source = resolve_model(args.model)
    n = source.spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    ranges = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    ids = torch.randint(3, source.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    prompt = [int(i) for i in ids]
    reference = source.load_reference_model()
    extra = ["--no-follow-plan", "--cache-tokens", "16384", *args.peer_args.split()]
    client_kwargs: dict[str, object] = {"spot_check_rate": 0.0, "step_timeout_s": 300.0}
    report: dict[str, object] = {
        "model": source.spec.name,
        "tokens": args.tokens,
        "peer_args": args.peer_args,
    }
    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-bench-") as tmp,
        LocalSwarm(Path(tmp), model=args.model) as swarm,
    ):
        swarm.start_peer(layers=ranges[0], name="peer-a", timeout_s=300, extra_args=extra)
        for name, layers in zip(("peer-b", "peer-c"), ranges[1:], strict=True):
            swarm.start_peer(layers=layers, name=name, wait=False, extra_args=extra)
        swarm.wait_all_ready(timeout_s=300)
        with SwarmClient(swarm.initial_peers, model=args.model, **client_kwargs) as client:  # type: ignore[arg-type]
            client.run(swarm_ttft(client.aclient, prompt[:64]))  # warm up connections
            if not args.skip_ttft:
                report.update(ttft_report(client, reference, prompt, args.repeats, args.client_chunk_tokens))
            print(json.dumps(report), file=sys.stderr, flush=True)
            if not args.skip_decode:
                report["decode_during_prefill"] = client.run(
                    decode_during_prefill(client.aclient, prompt, args.sessions)
                )
    report["load_avg_1m"] = round(os.getloadavg()[0], 2)
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
