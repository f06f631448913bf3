#!/usr/bin/env python
"""End-to-end serving speed of a real local swarm next to local transformers, in ONE run. Prints ONE JSON object.

Three `swarm-peer join` processes on 127.0.0.1 each hold a third of the layers (10 of the default model's 30;
--no-follow-plan keeps them there), every process runs one torch thread, and the plain transformers model runs
in this process as the reference. Phases, in order (progress goes to stderr):

  decode       64 greedy tokens (EOS ignored) after the 37-token chat prompt, best of --repeats: tokens/s after
               the first token. Swarm, local transformers and (blocks_decode_tok_s) this project's own model code
               with every layer in this process alternate: swarm / blocks is what the network costs alone.
  ttft         time to the first token of 37-, 512- and 2048-token prompts, swarm and local (best of repeats).
  one_client   N generations at once in this process's one AsyncSwarmClient (asyncio.gather).
  prefill      4 sessions decode; meanwhile a 2048-token prompt is prefilled: their inter-token gaps (ms) while
               it runs (p50, p99), and before it started (p50_alone).
  processes    N client processes (started once, then told to go together) generating at once.

Aggregate tokens/s = decode steps of all sessions inside the common window (from the last session's first
token to the first session's last token) / the window's length; sessions' prefills are outside it. Each
aggregate phase also gives the machine's busy cores and where they went: CPU ms per generated token by process
role and thread (cpu_ms_per_token: peers' decode and prefill lanes and event loops, clients' heads and loops,
p2pd, DHT children; see cpu_by_thread), how long the same threads were ready to run but waited for a core
(runqueue_ms_per_token, from schedstat: on 2 cores a step's latency holds these waits too), and when the last
session's first token came (last_first_token_s: the sessions' prompts wait behind the running sessions' decode
steps). The model's own arithmetic for a token of 1 and of 8 sessions, timed in this process alone
(arithmetic_ms), gives what 8 sessions may spend beyond it per token and still reach 4x the single session with
every core busy, next to what they spent (budget_for_4x_ms_per_token; see budget_for_target).

    .venv/bin/python scripts/bench_e2e.py --json e2e.json --png e2e.png     # default model, full sizes
    .venv/bin/python scripts/bench_e2e.py --quick                           # tiny model, small sizes (CI)

With --ab B_ARGS it runs a paired A/B of peer settings instead: swarm A (--peer-args) and swarm B (B_ARGS) side
by side, each with its own client processes, and --rounds rounds that each run every level of --sessions (1 8)
on A and on B back to back, the order flipping each round, so both see the same minute of the machine (on a
shared machine the same code's speed drifts from one minute to the next by more than most settings change
it). A swarm that is not measured idles. It reports per setting and level the aggregate tokens/s of each round
and their median, and per level B / A of each round and its median.

    .venv/bin/python scripts/bench_e2e.py --ab "--executor-ride-along-tokens 0" --rounds 6 --json ab.json
    .venv/bin/python scripts/bench_e2e.py --ab="--executor-shared-device off"   # a flag with "=" when it starts the value
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from client import AsyncSwarmClient, SwarmClient  # noqa: E402
from client.batching import HEAD_THREAD  # noqa: E402
from client.generation import GenerationRequest, generate_ids, timed_ids  # noqa: E402
from swarm.errors import SessionError  # noqa: E402
from swarm.models import Sampler, SamplingParams, resolve_model  # noqa: E402
from swarm.models.blocks import BlockRange, Step  # noqa: E402
from swarm.models.head import ClientHead  # noqa: E402
from swarm.models.loading import ModelSource  # noqa: E402
from swarm.models.quant import reference_config  # noqa: E402
from swarm.peer.executor import DECODE_THREAD, PREFILL_THREAD  # noqa: E402
from swarm.peer.measure import sync_device  # noqa: E402
from swarm.peer.server import BATCH_LOG_INTERVAL_S  # noqa: E402
from swarm.testing import LocalSwarm  # noqa: E402
from swarm.testing.launcher import log_tail  # noqa: E402
from swarm.testing.prompts import chat_prompt_ids  # noqa: E402
from swarm.types import QUANT_KINDS  # noqa: E402

OWN_MODEL_PACK_BYTES = 2**40  # blocks_decode's range may keep any packed copy, as the peers here can
STEP_TIMEOUT_S = 600.0  # a 2048-token prefill on a busy shared machine can take far past the client's default
QUESTION = "What is the capital of France?"  # 37 tokens with SmolLM2's chat template
TARGET_SESSIONS = 8  # the aggregate target: this many sessions together ...
TARGET_MULTIPLE = 4  # ... at this many times one session's tokens/s
# arithmetic_ms's rounds: this many per --repeats, plus one (an odd count, whose median is one round)
ARITHMETIC_ROUNDS_PER_REPEAT = 4
_V = TypeVar("_V")


def log(message: str) -> None:
    print(f"[bench_e2e {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="OUT", help="also write the JSON object to this file")
    parser.add_argument("--png", metavar="PLOT", help="plot aggregate tokens/s against sessions")
    parser.add_argument("--quick", action="store_true", help="tiny model, small sizes (the CI smoke run)")
    parser.add_argument("--model", default=None, help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--peers", type=int, default=3, help="peers, each holding an equal run of layers")
    parser.add_argument("--new-tokens", type=int, default=None, help="single-session decode tokens (64)")
    parser.add_argument(
        "--aggregate-tokens", type=int, default=None, help="tokens per concurrent session (64)"
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=None, help="concurrency levels (1 4 8 16)")
    parser.add_argument("--ttft-tokens", type=int, nargs="+", default=None, help="prompt sizes (37 512 2048)")
    parser.add_argument("--long-prompt", type=int, default=None, help="prefill under decode (2048)")
    parser.add_argument("--decoders", type=int, default=4, help="sessions decoding during the long prefill")
    parser.add_argument("--repeats", type=int, default=None, help="best of this many runs (2)")
    parser.add_argument("--spot-check-rate", type=float, default=None, help="client's (default: its own)")
    parser.add_argument(
        "--batch-lanes", type=int, default=None, help="ClientConfig.batch_lanes of the clients"
    )
    parser.add_argument("--peer-args", default="", help="extra `swarm-peer join` arguments, one string")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N: the peers', the clients' heads' and the reference's",
    )
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16, likewise")
    parser.add_argument(
        "--quant",
        default="none",
        choices=QUANT_KINDS,
        help="the peers' --quant, the own model code's, and the reference's (transformers with the same"
        " BitsAndBytesConfig)",
    )
    parser.add_argument(
        "--ab", metavar="B_ARGS", default=None, help="paired A/B: a second swarm with these peer arguments"
    )
    parser.add_argument("--rounds", type=int, default=None, help="--ab's rounds, each measuring A and B (6)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["processes", "one_client", "prefill"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a client process
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--client-options", default="{}", help=argparse.SUPPRESS)  # a worker's ClientConfig
    args = parser.parse_args(argv)
    # Concurrent sessions decode as many tokens as the single session (64): the common window then covers
    # the sessions' steady pace, not mostly their first steps after the staggered prefills (shorter runs
    # scattered widely across runs of the same code; docs/benchmarks.md).
    full = {"model": "default", "new_tokens": 64, "aggregate_tokens": 64, "sessions": [1, 4, 8, 16],
            "ttft_tokens": [37, 512, 2048], "long_prompt": 2048, "repeats": 2, "rounds": 6}  # fmt: skip
    quick = {"model": "tiny", "new_tokens": 8, "aggregate_tokens": 6, "sessions": [1, 2],
             "ttft_tokens": [37, 64], "long_prompt": 96, "repeats": 1, "rounds": 1}  # fmt: skip
    if args.ab is not None and args.sessions is None and not args.quick:
        args.sessions = [1, 8]
    if args.ab is not None and args.png:
        parser.error("--png plots the full run's phases, not --ab's")
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 2 or args.aggregate_tokens < 2 or args.repeats < 1 or min(args.sessions) < 1:
        parser.error("need --new-tokens >= 2, --aggregate-tokens >= 2, --repeats >= 1, --sessions >= 1")
    if args.rounds < 1:
        parser.error("need --rounds >= 1")
    return args


# --- one session: decode and time to first token --------------------------------------------------------------


def greedy_request(ids: Sequence[int], new_tokens: int) -> GenerationRequest:
    return GenerationRequest(tuple(ids), new_tokens, eos_ids=frozenset())  # EOS ignored, like the local runs


async def timeline(client: AsyncSwarmClient, ids: Sequence[int], new_tokens: int) -> list[float]:
    """perf_counter times of one greedy session: before the prefill, then as each token arrives."""
    session = client.new_session(len(ids) + new_tokens)
    try:
        _tokens, times = await timed_ids(
            session, greedy_request(ids, new_tokens), Sampler(SamplingParams()).sample, argmax_only=True
        )
    finally:
        await session.close()
    return times


async def timelines_together(
    client: AsyncSwarmClient, n: int, ids: Sequence[int], new_tokens: int
) -> list[list[float]]:
    """`n` greedy sessions started at once in one client (asyncio.gather)."""
    return list(await asyncio.gather(*(timeline(client, ids, new_tokens) for _ in range(n))))


async def swarm_decode(
    client: AsyncSwarmClient, ids: Sequence[int], new_tokens: int
) -> tuple[float, list[int]]:
    """(decode tokens/s after the first token, the tokens) of one greedy session through the swarm."""
    session = client.new_session(len(ids) + new_tokens)
    try:
        tokens, times = await timed_ids(
            session, greedy_request(ids, new_tokens), Sampler(SamplingParams()).sample, argmax_only=True
        )
    finally:
        await session.close()
    return (new_tokens - 1) / (times[-1] - times[1]), tokens


async def swarm_ttft(client: AsyncSwarmClient, ids: Sequence[int]) -> float:
    times = await timeline(client, ids, 1)
    return times[1] - times[0]


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def local_decode(model: torch.nn.Module, ids: Sequence[int], new_tokens: int) -> tuple[float, list[int]]:
    """The same greedy decode with transformers' own KV cache, in this process: (tokens/s, tokens)."""
    with torch.inference_mode():
        out = model(torch.tensor([list(ids)], device=_device_of(model)), use_cache=True)
        first = time.perf_counter()
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(new_tokens - 1):
            out = model(
                torch.tensor([tokens[-1:]], device=_device_of(model)),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            tokens.append(int(out.logits[0, -1].argmax()))
        return (new_tokens - 1) / (time.perf_counter() - first), tokens


def blocks_decode(
    source: ModelSource,
    ids: Sequence[int],
    new_tokens: int,
    device: str = "cpu",
    dtype: str = "float32",
    quant: str = "none",
) -> tuple[float, list[int]]:
    """The same greedy decode through this project's own model code (every layer on one BlockRange, the client's
    head) in this process: what the swarm computes, without the network: (tokens/s, tokens)."""
    num_layers = source.spec.num_layers
    blocks, head = _own_model(source, device, dtype, quant)
    with _sessions(blocks, 1, len(ids) + new_tokens) as (session,):
        hidden = blocks.forward([Step(session, head.embed(torch.tensor(list(ids))), 0, num_layers, 0)])[0]
        first = time.perf_counter()
        tokens = [int(head.logits(hidden[-1:])[0].argmax())]
        for i in range(new_tokens - 1):
            step = Step(session, head.embed(torch.tensor(tokens[-1:])), 0, num_layers, len(ids) + i)
            tokens.append(int(head.logits(blocks.forward([step])[0])[0].argmax()))
        return (new_tokens - 1) / (time.perf_counter() - first), tokens


@contextlib.contextmanager
def _sessions(blocks: BlockRange, count: int, max_tokens: int) -> Iterator[list[str]]:
    """``count`` fresh sessions of ``max_tokens`` on ``blocks`` (the cached _own_model's, which later phases use
    again), closed on the way out, also when opening one of them fails."""
    opened: list[str] = []
    try:
        for _ in range(count):
            opened.append(uuid.uuid4().hex)
            blocks.open_session(opened[-1], max_tokens)
        yield opened
    finally:
        for session in opened:
            with contextlib.suppress(SessionError):  # the one whose open failed
                blocks.close_session(session)


def arithmetic_ms(
    source: ModelSource,
    ids: Sequence[int],
    peers: int,
    rounds: int,
    device: str = "cpu",
    dtype: str = "float32",
    quant: str = "none",
) -> dict[str, dict[str, float]]:
    """The model's own arithmetic for one decode token of 1 and of ``TARGET_SESSIONS`` sessions, as the swarm
    splits it, in this process with nothing else in the way: the peers' decode calls (one per range of
    ``layer_cuts``, in turn; their sum) and the client head's greedy step on their outputs (``argmax_only``, its
    tokens read as a client reads them), medians of ``rounds`` rounds, 1 and 8 rows in turn, the first of them
    flipping each round. Ms by rows: {"hops": {"1", "8"}, "head": {"1", "8"}}."""
    blocks, head = _own_model(source, device, dtype, quant)
    cuts = layer_cuts(source.spec.num_layers, peers)
    times: dict[str, dict[str, list[float]]] = {"hops": defaultdict(list), "head": defaultdict(list)}
    with _sessions(blocks, 1 + TARGET_SESSIONS, len(ids) + rounds) as sessions:
        prompt = head.embed(torch.tensor(list(ids[:-1])))
        for session in sessions:
            blocks.forward([Step(session, prompt, 0, source.spec.num_layers, 0)])
        token = head.embed(torch.tensor(list(ids[-1:])))
        groups = (sessions[:1], sessions[1:])
        for position in range(len(ids) - 1, len(ids) - 1 + rounds):
            for group in groups if position % 2 else groups[::-1]:
                hidden = [token] * len(group)
                began = time.perf_counter()
                for start, end in zip(cuts, cuts[1:], strict=False):
                    if start < end:
                        steps = [Step(s, h, start, end, position) for s, h in zip(group, hidden, strict=True)]
                        hidden = blocks.forward(steps)
                sync_device(blocks.device)  # a GPU's calls have only been queued
                computed = time.perf_counter()
                head.logits(torch.cat(hidden), argmax_only=True).argmax(-1).tolist()
                times["hops"][str(len(group))].append(1000 * (computed - began))
                times["head"][str(len(group))].append(1000 * (time.perf_counter() - computed))
    return {
        part: {rows: round(statistics.median(ms), 3) for rows, ms in by_rows.items()}
        for part, by_rows in times.items()
    }


def budget_for_target(
    arithmetic: dict[str, dict[str, float]], single_tok_s: float, cpus: int
) -> dict[str, float]:
    """CPU ms per token that ``TARGET_SESSIONS`` sessions may spend beyond the model's arithmetic (messages, event
    loops, daemons, spot-checks) and still reach ``TARGET_MULTIPLE`` times the single session's
    tokens/s, with all ``cpus`` cores busy all the time: cpus * (ms per token of the single session) / the
    multiple, less the arithmetic of a token among them (``arithmetic_ms``). Client processes share no head: each
    steps its own on one row; one client steps all its sessions' rows at once. Under 0: out of reach on this
    machine even were all of that free. Every ms taken off the single session's own path takes cpus / multiple
    ms off it too."""
    n = str(TARGET_SESSIONS)
    hops, head = arithmetic["hops"], arithmetic["head"]
    allowed = cpus * (1000 / single_tok_s) / TARGET_MULTIPLE
    return {
        "processes": round(allowed - head["1"] - hops[n] / TARGET_SESSIONS, 2),
        "one_client": round(allowed - (head[n] + hops[n]) / TARGET_SESSIONS, 2),
    }


def _budget(single: dict[str, Any], seen: Seen, device: str) -> dict[str, dict[str, float | None]] | None:
    """budget_for_target on the cores this process may use, and beyond_arithmetic of the 8-session phases; None
    on a GPU, where the arithmetic is not the cores' to share."""
    if torch.device(device).type != "cpu":
        return None
    allowed = budget_for_target(single["arithmetic"], single["swarm"], len(os.sched_getaffinity(0)))
    return {
        mode: {
            "allowed": ms,
            "spent": beyond_arithmetic(seen.cpu_ms_per_token.get(f"{mode}/{TARGET_SESSIONS}")),
        }
        for mode, ms in allowed.items()
    }


def beyond_arithmetic(cpu_ms: dict[str, float] | None) -> float | None:
    """CPU ms per token of a phase (cpu_ms_per_token) outside the threads that compute the model (the peers'
    decode and prefill lanes, the clients' heads): messages, event loops, daemons, DHT nodes. Over the whole phase,
    so it also holds the prompts' messages, not only the decode window's."""
    if cpu_ms is None:
        return None
    compute_threads = {f"peer {DECODE_THREAD}", f"peer {PREFILL_THREAD}", f"client {HEAD_THREAD}"}
    return round(sum(ms for role, ms in cpu_ms.items() if role not in compute_threads), 2)


@functools.cache
def _own_model(
    source: ModelSource, device: str, dtype: str, quant: str = "none"
) -> tuple[BlockRange, ClientHead]:
    # the products in the forms a peer with memory to spare takes (packed or 4-bit weights, as calibrated)
    blocks = source.load_blocks(
        0,
        source.spec.num_layers,
        device,
        dtype,
        cache_tokens=4096,
        pack_bytes=OWN_MODEL_PACK_BYTES,
        quant=quant,
    )
    return blocks, source.load_head(device, dtype)


def reference_model(source: ModelSource, device: str, dtype: str, quant: str) -> torch.nn.Module:
    """Local transformers: the plain model, or for a ``quant`` the model loaded with the BitsAndBytesConfig
    that quantizes it as the peers do (swarm.models.quant.reference_config)."""
    if quant == "none":
        return source.load_reference_model(device, dtype)
    from transformers import AutoModelForCausalLM

    torch_type = getattr(torch, dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(
        source.path,
        quantization_config=reference_config(quant, torch_type),
        dtype=torch_type,
        device_map=device,
        local_files_only=True,
    )
    return model.eval()


def local_ttft(model: torch.nn.Module, ids: Sequence[int]) -> float:
    with torch.inference_mode():
        began = time.perf_counter()
        out = model(torch.tensor([list(ids)], device=_device_of(model)), use_cache=True)
        int(out.logits[0, -1].argmax())
        return time.perf_counter() - began


def prompt_of(source: ModelSource, size: int) -> list[int]:
    """A `size`-token prompt: text of the question repeated, ending with the chat prompt (ids cycled for the
    tiny model, which has no tokenizer)."""
    tail = chat_prompt_ids(source, QUESTION)
    tokenizer = source.tokenizer()
    if tokenizer is None:
        return [(7 * i + 3) % source.spec.vocab_size for i in range(size)]
    filler = tokenizer(" ".join([QUESTION] * size), add_special_tokens=False)["input_ids"]
    ids = [*filler[: max(0, size - len(tail))], *tail][-size:]
    if len(ids) != size:
        raise ValueError(f"could not build a {size}-token prompt")
    return ids


# --- many sessions ---------------------------------------------------------------------------------------------


def aggregate_tok_s(timelines: Sequence[Sequence[float]]) -> float:
    """Decode steps of all sessions inside the window where every one of them is decoding, per second.

    The window runs from the last session's first token to the first session's last; when sessions barely
    overlap (window under a tenth of the span), all decode steps over the whole span count instead."""
    start = max(t[1] for t in timelines)
    end = min(t[-1] for t in timelines)
    span = max(t[-1] for t in timelines) - min(t[1] for t in timelines)
    if end - start < 0.1 * span:
        return sum(len(t) - 2 for t in timelines) / span
    steps = sum(1 for t in timelines for x in t[2:] if start < x <= end)
    return steps / (end - start)


def longest_gap_ms(timelines: Sequence[Sequence[float]]) -> float:
    """The longest wait between two decode tokens of any session: a stall of the whole swarm (a full garbage
    collection in a peer, a hung hop) shows here, where the aggregate hides it among the good rounds."""
    return round(1000 * max(b - a for t in timelines for a, b in zip(t[1:], t[2:], strict=False)), 1)


def last_first_s(timelines: Sequence[Sequence[float]]) -> float:
    """Seconds from the first session's start to the last session's first token: for sessions started together,
    how long the last one waited for its prompt (the others' decode steps go first)."""
    return round(max(t[1] for t in timelines) - min(t[0] for t in timelines), 3)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def decode_during_prefill(
    client: AsyncSwarmClient, ids: Sequence[int], long_prompt: Sequence[int], decoders: int
) -> dict[str, float]:
    """Inter-token gaps (ms) of `decoders` running sessions while `long_prompt` is prefilled, and before."""
    stop = asyncio.Event()
    gaps: list[list[tuple[float, float]]] = [[] for _ in range(decoders)]  # (token time, gap) per session
    cap = 512  # decode steps at most (a client may reserve 8192 cache tokens per peer); they stop after the prefill

    async def decode(i: int) -> None:
        session = client.new_session(len(ids) + cap)
        pick = Sampler(SamplingParams()).sample
        try:
            async with contextlib.aclosing(
                generate_ids(session, greedy_request(ids, cap), pick, True)
            ) as stream:
                last = None
                async for _ in stream:
                    now = time.perf_counter()
                    if last is not None:
                        gaps[i].append((now, now - last))
                    last = now
                    if stop.is_set():
                        break
        finally:
            await session.close()

    tasks = [asyncio.create_task(decode(i)) for i in range(decoders)]
    async with asyncio.timeout(300):
        while min(len(g) for g in gaps) < 24:  # every session decoding steadily: that is the "alone" sample
            failed = [t for t in tasks if t.done()]
            if failed:
                await failed[0]  # raises its error; a session that ended early is a bug here too
                raise RuntimeError("a decoding session ended before the long prefill began")
            await asyncio.sleep(0.01)
    alone = [gap for g in gaps for _, gap in g[8:]]
    began = time.perf_counter()
    await swarm_ttft(client, long_prompt)
    ended = time.perf_counter()
    await asyncio.sleep(0.2)  # a few steps after, so the gap spanning the prefill's end is counted
    stop.set()
    await asyncio.gather(*tasks)
    during = [gap for g in gaps for at, gap in g if began < at and at - gap < ended]
    return {
        "p50": round(1000 * statistics.median(during), 2),
        "p99": round(1000 * percentile(during, 99), 2),
        "p50_alone": round(1000 * statistics.median(alone), 2),
        "prefill_s": round(ended - began, 3),
        "gaps_during": len(during),
    }


# --- client processes --------------------------------------------------------------------------------------------


class Workers:
    """Client processes (this script with --worker), started once and told to generate together."""

    def __init__(
        self, tmp: Path, initial_peers: Sequence[str], model: str, count: int, options: dict[str, Any]
    ):
        command = [sys.executable, __file__, "--worker", "--model", model, "--initial-peers", *initial_peers]
        command += ["--client-options", json.dumps(options)]
        self.procs = []
        for i in range(count):
            with open(tmp / f"client-{i}.log", "wb") as log_file:
                self.procs.append(
                    subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log_file,
                        text=True,
                        env={**os.environ, "FLOWSWARM_THREADS": "1"},
                    )  # fmt: skip
                )

    def wait_ready(self) -> None:
        for proc in self.procs:
            self._read(proc)  # "ready"

    @staticmethod
    def _read(proc: subprocess.Popen[str]) -> Any:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise RuntimeError(f"client process {proc.pid} exited with {proc.wait()}; see its log")
        return json.loads(line)

    def run_together(self, n: int, ids: Sequence[int], new_tokens: int) -> list[list[float]]:
        """Monotonic timelines of `n` processes generating at once (each told as close together as we can)."""
        order = json.dumps({"ids": list(ids), "new_tokens": new_tokens}) + "\n"
        for proc in self.procs[:n]:
            assert proc.stdin is not None
            proc.stdin.write(order)
            proc.stdin.flush()
        return [self._read(proc)["times"] for proc in self.procs[:n]]

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                if proc.stdin:
                    proc.stdin.close()  # end of input: the worker leaves the swarm and exits
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def worker_main(initial_peers: Sequence[str], model: str, options: dict[str, Any]) -> None:
    """A client process: connect, say ready, then run one greedy session per order line until stdin ends."""
    offset = (
        time.monotonic() - time.perf_counter()
    )  # timelines in CLOCK_MONOTONIC, comparable across processes
    with SwarmClient(initial_peers, model=model, **options) as client:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            order = json.loads(line)
            times = client.run(timeline(client.aclient, order["ids"], order["new_tokens"]))
            print(json.dumps({"times": [t + offset for t in times]}), flush=True)


def layer_cuts(num_layers: int, peers: int) -> list[int]:
    """Where the peers' equal runs of layers start, and the last one ends."""
    return [round(i * num_layers / peers) for i in range(peers + 1)]


def start_swarm(
    swarm: LocalSwarm, peers: int, peer_args: str, num_layers: int, args: argparse.Namespace
) -> list[str]:
    """Start the peers, each on a fixed equal run of layers; returns their ranges once the first serves."""
    cuts = layer_cuts(num_layers, peers)
    ranges = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    # --no-plan: the peers hold fixed layers, so a plan changes nothing here, but the elected planner's solver
    # process (its first solves, and a re-solve whenever load moves the measured speeds) would share this
    # machine's two cores with the phases being measured.
    fixed = ["--no-follow-plan", "--no-plan", "--cache-tokens", "16384", "--device", args.device]
    fixed += ["--dtype", args.dtype, "--quant", args.quant, *peer_args.split()]
    for i, layers in enumerate(ranges):
        swarm.start_peer(layers=layers, name=f"peer-{i}", wait=i == 0, timeout_s=300, extra_args=fixed)
    return ranges


def measure_single(
    client: SwarmClient, reference: torch.nn.Module, ids: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Decode speed and time to first token, swarm and local alternating (the machine is shared and noisy)."""
    source = resolve_model(args.model)
    best = {"swarm": 0.0, "local": 0.0, "blocks": 0.0}
    match = True
    for _ in range(args.repeats):
        swarm_tok_s, swarm_tokens = client.run(swarm_decode(client.aclient, ids, args.new_tokens))
        local_tok_s, local_tokens = local_decode(reference, ids, args.new_tokens)
        blocks_tok_s, blocks_tokens = blocks_decode(
            source, ids, args.new_tokens, args.device, args.dtype, args.quant
        )
        best = {
            "swarm": max(best["swarm"], swarm_tok_s),
            "local": max(best["local"], local_tok_s),
            "blocks": max(best["blocks"], blocks_tok_s),
        }
        match &= swarm_tokens == local_tokens == blocks_tokens
    log(
        f"decode: swarm {best['swarm']:.1f} tok/s, local {best['local']:.1f} tok/s, own model code in one "
        f"process {best['blocks']:.1f} tok/s, tokens match: {match}"
    )
    ttft: dict[str, dict[str, float]] = {}
    for size in args.ttft_tokens:
        prompt = ids if size == len(ids) else prompt_of(source, size)
        repeats = args.repeats if size < 512 else 1  # a long prefill is long enough to average out noise
        swarm_s = min(client.run(swarm_ttft(client.aclient, prompt)) for _ in range(repeats))
        local_s = min(local_ttft(reference, prompt) for _ in range(repeats))
        ttft[str(size)] = {"local": round(local_s, 4), "swarm": round(swarm_s, 4)}
        log(f"ttft {size}: swarm {swarm_s:.3f} s, local {local_s:.3f} s")
    rounds = ARITHMETIC_ROUNDS_PER_REPEAT * args.repeats + 1
    arithmetic = arithmetic_ms(source, ids, args.peers, rounds, args.device, args.dtype, args.quant)
    log(f"arithmetic of a decode token (ms, by rows): {arithmetic}")
    return {**best, "ttft": ttft, "tokens_match": match, "arithmetic": arithmetic}


@dataclass
class Seen:
    """What the phases showed, by phase ("processes/8", "one_client/4", "prefill")."""

    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # (start, end): seconds of the day
    gaps_ms: dict[str, float] = field(default_factory=dict)  # its longest decode gap (longest_gap_ms)
    last_first_s: dict[str, float] = field(default_factory=dict)  # when its last first token came
    busy_cores: dict[str, float | None] = field(default_factory=dict)  # cores_busy_since its start
    # CPU ms per generated token by process role and thread (cpu_by_thread), summed over the phase
    cpu_ms_per_token: dict[str, dict[str, float]] = field(default_factory=dict)
    # ms per generated token those threads were runnable but waiting for a core (waiting_by_thread)
    runqueue_ms_per_token: dict[str, dict[str, float]] = field(default_factory=dict)

    def phase(
        self,
        name: str,
        began: float,
        jiffies: tuple[int, int] | None,
        cpu: dict[str, float] | None,
        waiting: dict[str, float] | None,
        tokens: int,
    ) -> None:
        """Note what the machine did in phase ``name`` since ``began``, ``jiffies``, ``cpu`` and ``waiting`` (its
        start)."""
        self.windows[name] = (began, clock())
        self.busy_cores[name] = cores_busy_since(jiffies)
        for before, after, into in (
            (cpu, cpu_by_thread(), self.cpu_ms_per_token),
            (waiting, waiting_by_thread(), self.runqueue_ms_per_token),
        ):
            if before is not None and after is not None:
                per_token = {
                    k: round(1000 * (after[k] - before.get(k, 0.0)) / tokens, 2) for k in sorted(after)
                }
                into[name] = {k: ms for k, ms in per_token.items() if ms > 0}


def by_mode(per_phase: dict[str, _V]) -> dict[str, dict[str, _V]]:
    """{"processes/8": x} -> {"processes": {"8": x}, "one_client": {}}."""
    return {
        mode: {phase.split("/")[1]: v for phase, v in per_phase.items() if phase.startswith(f"{mode}/")}
        for mode in ("processes", "one_client")
    }


def measure_one_client(
    client: SwarmClient,
    ids: list[int],
    args: argparse.Namespace,
    seen: Seen,
) -> dict[str, float]:
    """Aggregate tokens/s of N generations at once in one AsyncSwarmClient."""
    rates = {}
    for n in args.sessions:
        began, jiffies, cpu, waiting = clock(), cpu_jiffies(), cpu_by_thread(), waiting_by_thread()
        head = client.aclient.batcher
        calls, rows = head.calls, head.rows
        timelines = client.run(timelines_together(client.aclient, n, ids, args.aggregate_tokens))
        calls, rows = head.calls - calls, head.rows - rows
        seen.phase(f"one_client/{n}", began, jiffies, cpu, waiting, n * args.aggregate_tokens)
        rates[str(n)] = round(aggregate_tok_s(timelines), 2)
        seen.gaps_ms[f"one_client/{n}"] = longest_gap_ms(timelines)
        seen.last_first_s[f"one_client/{n}"] = last_first_s(timelines)
        log(
            f"one client, {n} sessions: {rates[str(n)]} tok/s (client head: {rows / max(1, calls):.1f} rows/call)"
        )
    return rates


def measure_processes(
    workers: Workers,
    ids: list[int],
    args: argparse.Namespace,
    seen: Seen,
) -> dict[str, float]:
    """Aggregate tokens/s of N client processes generating at once."""
    rates = {}
    for n in args.sessions:
        began, jiffies, cpu, waiting = clock(), cpu_jiffies(), cpu_by_thread(), waiting_by_thread()
        timelines = workers.run_together(n, ids, args.aggregate_tokens)
        seen.phase(f"processes/{n}", began, jiffies, cpu, waiting, n * args.aggregate_tokens)
        rates[str(n)] = round(aggregate_tok_s(timelines), 2)
        seen.gaps_ms[f"processes/{n}"] = longest_gap_ms(timelines)
        seen.last_first_s[f"processes/{n}"] = last_first_s(timelines)
        log(f"{n} client processes: {rates[str(n)]} tok/s")
    return rates


def plot(path: str, aggregate: dict[str, dict[str, float]], single: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("processes", "client processes"), ("one_client", "one client, N generations")):
        if aggregate.get(mode):
            sessions = sorted(int(n) for n in aggregate[mode])
            ax.plot(sessions, [aggregate[mode][str(n)] for n in sessions], marker="o", label=label)
    ax.axhline(single, color="grey", linestyle=":", label="one session")
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title("FlowSwarm: 3 peers on 127.0.0.1, 1 torch thread each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_in_client(
    client: SwarmClient,
    reference: torch.nn.Module,
    source: ModelSource,
    ids: list[int],
    args: argparse.Namespace,
    seen: Seen,
    phases: dict[str, float],
) -> tuple[dict[str, Any], dict[str, float], dict[str, float], dict[str, float]]:
    """The phases run from this process's client: single session, one client's N sessions, prefill."""
    mark = time.perf_counter()
    single = measure_single(client, reference, ids, args)
    phases["single"], mark = time.perf_counter() - mark, time.perf_counter()
    one_client = measure_one_client(client, ids, args, seen) if "one_client" not in args.skip else {}
    phases["one_client"], mark = time.perf_counter() - mark, time.perf_counter()
    during: dict[str, float] = {}
    if "prefill" not in args.skip:
        start = clock()
        long_prompt = prompt_of(source, args.long_prompt)
        during = client.run(decode_during_prefill(client.aclient, ids, long_prompt, args.decoders))
        seen.windows["prefill"] = (start, clock())
        log(f"decode during a {args.long_prompt}-token prefill: {during}")
    phases["prefill_under_decode"] = time.perf_counter() - mark
    head = client.aclient.batcher
    stats = {
        "calls": head.calls,
        "mean_rows": round(head.rows / max(1, head.calls), 2),
        "largest": head.largest,
    }
    return single, one_client, during, stats


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ClientConfig fields the command line sets for this process's client and the client processes."""
    options: dict[str, Any] = {
        "step_timeout_s": STEP_TIMEOUT_S,
        "device": args.device,
        "dtype": args.dtype,
        "quant": args.quant,  # routes through the peers of that --quant only
    }
    if args.spot_check_rate is not None:
        options["spot_check_rate"] = args.spot_check_rate
    if args.batch_lanes is not None:
        options["batch_lanes"] = args.batch_lanes
    return options


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    phases: dict[str, float] = {}
    seen = Seen()
    source = resolve_model(args.model)
    ids = chat_prompt_ids(source, QUESTION)
    reference = reference_model(source, args.device, args.dtype, args.quant)
    options = client_options(args)
    with (
        tempfile.TemporaryDirectory(prefix="flowswarm-e2e-") as tmp,
        LocalSwarm(Path(tmp), model=args.model) as swarm,
        contextlib.ExitStack() as stack,
    ):
        ranges = start_swarm(swarm, args.peers, args.peer_args, source.spec.num_layers, args)
        swarm.wait_all_ready(timeout_s=300)
        phases["start_peers"] = time.perf_counter() - began
        log(f"peers serving {ranges} after {phases['start_peers']:.0f} s")
        phases["settle"] = wait_quiet()
        with SwarmClient(swarm.initial_peers, model=args.model, **options) as client:
            single, one_client, during, head_stats = measure_in_client(
                client, reference, source, ids, args, seen, phases
            )
        processes: dict[str, float] = {}
        if "processes" not in args.skip:
            # Started only now: idle client processes still keep up their DHT nodes, which would slow the
            # single-session figures above (local and swarm alike) on a 2-core machine.
            mark = time.perf_counter()
            count = max(args.sessions)
            workers = stack.enter_context(Workers(Path(tmp), swarm.initial_peers, args.model, count, options))
            workers.wait_ready()
            phases["start_clients"] = time.perf_counter() - mark
            log(f"{count} client processes ready after {phases['start_clients']:.0f} s")
            mark = time.perf_counter()
            processes = measure_processes(workers, ids, args, seen)
            phases["processes"] = time.perf_counter() - mark
        peer_batches, peer_computing = peer_batch_sizes(swarm, seen.windows)
    return {
        "local_decode_tok_s": round(single["local"], 2),
        "swarm_decode_tok_s": round(single["swarm"], 2),
        # this project's model code with every layer in this process: swarm / this is the network's cost alone
        "blocks_decode_tok_s": round(single["blocks"], 2),
        "ttft_s": single["ttft"],
        "aggregate_tok_s": {"processes": processes, "one_client": one_client},
        "longest_decode_gap_ms": by_mode(seen.gaps_ms),
        # sessions started together: when the last one's first token came, s after they began (last_first_s)
        "last_first_token_s": by_mode(seen.last_first_s),
        # the whole machine's busy cores (of "machine"'s cpus) during each aggregate phase, averaged over it
        "busy_cores": by_mode(seen.busy_cores),
        # where that CPU went: ms per generated token (prefill included) by process role and thread
        "cpu_ms_per_token": by_mode(seen.cpu_ms_per_token),
        # and how long those threads were ready to run but waited for a core, ms per generated token
        "runqueue_ms_per_token": by_mode(seen.runqueue_ms_per_token),
        "decode_during_long_prefill_ms": during,
        "targets": _targets(single, processes, one_client, during),
        # the peers' decode calls and the client's head step for a token of 1 and of 8 sessions, alone (ms)
        "arithmetic_ms": single["arithmetic"],
        # CPU ms per token that 8 sessions may spend beyond that arithmetic and reach 4x (budget_for_target),
        # and what they spent on it in this run (beyond_arithmetic)
        "budget_for_4x_ms_per_token": _budget(single, seen, args.device),
        "tokens_match": single["tokens_match"],
        "client_head_batches": head_stats,
        "peer_batches": peer_batches,
        "peer_computing_share": peer_computing,  # of the busy intervals' time, in forward calls (peer_batch_sizes)
        "model": source.spec.name,
        "quant": args.quant,
        "route": ranges,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "aggregate_tokens_per_session": args.aggregate_tokens,
        "repeats": args.repeats,
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "total_s": round(time.perf_counter() - began, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "threads_per_process": torch.get_num_threads(),
    }


def cpu_jiffies() -> tuple[int, int] | None:
    """(total, idle + iowait) jiffies of all cores so far (/proc/stat; None where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    return sum(fields), fields[3] + fields[4]


def cores_busy_since(before: tuple[int, int] | None) -> float | None:
    """How many cores the whole machine kept busy on average since ``before`` (cpu_jiffies)."""
    after = cpu_jiffies()
    if before is None or after is None:
        return None
    total, idle = after[0] - before[0], after[1] - before[1]
    return round((os.cpu_count() or 1) * (1 - idle / max(1, total)), 2)


def cpu_by_thread() -> dict[str, float] | None:
    """CPU seconds so far of the swarm's processes on this machine, by role and thread (None without /proc).

    Roles: "peer" (swarm-peer processes), "client" (this script and its client processes), "p2pd". A process
    forked by one with its very command line is its DHT child ("peer dht"). Threads: the lanes and loops the
    project names in the OS (swarm.models.threads: swarm-decode, swarm-prefill, swarm-head, swarm-client),
    "main", "other"."""
    return _by_thread(_cpu_s)


def waiting_by_thread() -> dict[str, float] | None:
    """Seconds so far the swarm's threads were ready to run but waited on a run queue for a core (schedstat), by
    role and thread as in cpu_by_thread (None without /proc or schedstat). On a busy machine a step's latency
    holds these waits as well as its threads' CPU time, though not every wait is on a step's path: p2pd's figure
    includes its Go runtime's monitor thread, which wakes several times a token whatever the load (most of a
    daemon's waits at one session; docs/benchmarks.md)."""
    return _by_thread(_waiting_s)


def _cpu_s(task: Path) -> float:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _waiting_s(task: Path) -> float:
    return int((task / "schedstat").read_text().split()[1]) / 1e9  # [on a cpu, waiting on a runqueue, slices]


def _by_thread(read: Callable[[Path], float]) -> dict[str, float] | None:
    """``read(/proc/PID/task/TID)`` summed by role and thread (see cpu_by_thread); None if nothing could be read."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    roles, commands, parents = {}, {}, {}
    for pid in pids:
        try:
            commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        roles[pid] = _role(pid, commands[pid])
    totals: dict[str, float] = defaultdict(float)
    read_any = False
    for pid, role in roles.items():
        if role is None:
            continue
        if role != "p2pd" and commands.get(parents[pid]) == commands[pid]:
            role += " dht"  # forked by a process of the same command line: hivemind's DHT child
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            task = Path(f"/proc/{pid}/task/{tid}")
            try:
                name = (task / "comm").read_text().strip()
                seconds = read(task)
            except (OSError, ValueError, IndexError):
                continue
            key = (
                role if role == "p2pd" or role.endswith(" dht") else f"{role} {_thread(name, int(tid), pid)}"
            )
            totals[key] += seconds
            read_any = True
    return totals if read_any else None


def _thread(name: str, tid: int, pid: int) -> str:
    """A thread's label: the name the project gave it in the OS, else "main" or "other"."""
    if name.startswith("swarm-"):
        return name
    return "main" if tid == pid else "other"


def _role(pid: int, command: bytes) -> str | None:
    if pid == os.getpid() or b"--worker" in command:
        return "client"
    if b"swarm.peer.cli" in command:
        return "peer"
    if command.split(b"\0", 1)[0].endswith(b"p2pd"):
        return "p2pd"
    return None


def busy_cores(interval_s: float = 2.0) -> float | None:
    """How many cores the whole machine kept busy over ``interval_s``."""
    before = cpu_jiffies()
    time.sleep(interval_s)
    return cores_busy_since(before)


def wait_quiet(max_s: float = 90.0, busy: float = 0.3) -> float:
    """Wait (at most ``max_s``) until the machine is nearly idle: a just-started swarm's planner solves its
    first plans in a process of its own, which would otherwise share the cores with the first phases. Returns
    the seconds waited."""
    began = time.perf_counter()
    while time.perf_counter() - began < max_s:
        cores = busy_cores()
        if cores is None or cores < busy:
            break
    waited = time.perf_counter() - began
    log(f"machine quiet after {waited:.0f} s")
    return waited


def _targets(
    single: dict[str, Any],
    processes: dict[str, float],
    one_client: dict[str, float],
    during: dict[str, float],
) -> dict[str, float | None]:
    """The issue's ratios, None where a phase was skipped or a size not measured."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    ttft = single["ttft"]
    return {
        "decode_vs_local": ratio(single["swarm"], single["local"]),  # target >= 0.92
        "decode_vs_own_blocks": ratio(single["swarm"], single["blocks"]),  # the network's cost alone
        "ttft_37_vs_local": ratio(ttft.get("37", {}).get("swarm"), ttft.get("37", {}).get("local")),  # <= 1.2
        "ttft_2048_vs_local": ratio(
            ttft.get("2048", {}).get("swarm"), ttft.get("2048", {}).get("local")
        ),  # <= 0.65
        "processes_8_vs_single": ratio(processes.get("8"), single["swarm"]),  # >= 4
        "one_client_8_vs_single": ratio(one_client.get("8"), single["swarm"]),  # >= 4
        "prefill_p99_vs_alone_p50": ratio(during.get("p99"), during.get("p50_alone")),  # <= 2
    }


EXECUTOR_LINE = re.compile(
    r"^(\d\d):(\d\d):(\d\d) .*executor: (\d+) steps in (\d+) forward calls(?:.*computing (\d+)%)?"
)


def clock() -> float:
    """Seconds since local midnight: the clock of the peers' log lines (HH:MM:SS)."""
    now = time.time()
    local = time.localtime(now)
    return local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + now % 1


def peer_batch_sizes(
    swarm: LocalSwarm, windows: dict[str, tuple[float, float]]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Per phase and peer: the executor's mean batch (steps / forward calls), and the share of the time its
    forward calls took (both lanes, from the event loop's view, so a little over the threads' own time), from
    the lines the peers log every few seconds for intervals with forward calls: a line covers the seconds before
    it, so a phase's figures are approximate, and idle intervals do not lower the share."""
    totals: dict[str, dict[str, list[int]]] = {phase: {} for phase in windows}
    for peer in swarm.peers:
        for line in log_tail(peer.log_path, 10**8).splitlines():
            match = EXECUTOR_LINE.match(line)
            if match is None:
                continue
            hours, minutes, seconds, steps, calls = (int(g) for g in match.groups()[:5])
            percent = match.group(6)  # None in a line of an older peer
            at = hours * 3600 + minutes * 60 + seconds
            for phase, (start, end) in windows.items():
                if start < at <= end + BATCH_LOG_INTERVAL_S:
                    counts = totals[phase].setdefault(peer.name, [0, 0, 0, 0])
                    counts[0] += steps
                    counts[1] += calls
                    if percent is not None:
                        counts[2] += int(percent)
                        counts[3] += 1
    batches = {
        phase: {name: round(c[0] / c[1], 2) for name, c in peers.items() if c[1]}
        for phase, peers in totals.items()
    }
    computing = {
        phase: {name: round(c[2] / c[3] / 100, 2) for name, c in peers.items() if c[3]}
        for phase, peers in totals.items()
    }
    return batches, computing


def run_ab(args: argparse.Namespace) -> dict[str, Any]:
    """The paired A/B of --peer-args (A) against --ab (B): see the module doc."""
    source = resolve_model(args.model)
    ids = chat_prompt_ids(source, QUESTION)
    settings = {"A": args.peer_args, "B": args.ab}
    levels = [str(n) for n in args.sessions]
    rates: dict[str, dict[str, list[float]]] = {name: {n: [] for n in levels} for name in settings}
    options = client_options(args)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flowswarm-ab-")))
        workers: dict[str, Workers] = {}
        for name, peer_args in settings.items():
            (tmp / name).mkdir()
            swarm = stack.enter_context(LocalSwarm(tmp / name, model=args.model))
            start_swarm(swarm, args.peers, peer_args, source.spec.num_layers, args)
            swarm.wait_all_ready(timeout_s=300)
            workers[name] = stack.enter_context(
                Workers(tmp / name, swarm.initial_peers, args.model, max(args.sessions), options)
            )
        for each in workers.values():
            each.wait_ready()
        wait_quiet()
        for i in range(args.rounds):
            for n in args.sessions:
                for name in "AB" if i % 2 == 0 else "BA":
                    rate = aggregate_tok_s(workers[name].run_together(n, ids, args.aggregate_tokens))
                    rates[name][str(n)].append(round(rate, 2))
                    log(f"round {i + 1}, {n} sessions, {name}: {rate:.2f} tok/s")
    ratios = {n: [round(b / a, 3) for a, b in zip(rates["A"][n], rates["B"][n], strict=True)] for n in levels}
    return {
        "settings": settings,
        "model": source.spec.name,
        "quant": args.quant,
        "tokens_per_session": args.aggregate_tokens,
        "aggregate_tok_s": rates,
        "median_tok_s": {name: {n: statistics.median(v[n]) for n in levels} for name, v in rates.items()},
        "ratio_b_over_a": ratios,
        "median_ratio_b_over_a": {n: statistics.median(v) for n, v in ratios.items()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # a SIGTERM (timeout, CI) unwinds like an exception, so the `with` blocks stop the peers and clients
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        worker_main(args.initial_peers, args.model, json.loads(args.client_options))
        return
    report = run_ab(args) if args.ab is not None else run(args)
    text = json.dumps(report)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.png:
        plot(args.png, report["aggregate_tok_s"], report["swarm_decode_tok_s"])
    print(text)


if __name__ == "__main__":
    main()
