#!/usr/bin/env python
"""Speculative decoding over emulated internet links: plain greedy against drafted-and-verified greedy. Prints
ONE JSON object.

The swarm of bench_wan's grid (3 peers x 10 layers of the default model, every peer and the client on a host of
its own, links changed live; needs root). For each one-way delay and prompt, one greedy session without drafts,
one per fixed draft length with the prompt-lookup drafter (client.drafting.PromptLookup), and one with the
length the client adapts per step ("lookup-auto", client.drafting.DraftLength), EOS ignored. Then, with the
adapted length too, the model drafters of client.draft_model: "model", a copy of the served model on the
client (the default model is the smallest of its family, so no smaller sibling exists: its own weights, held
as the peers hold them, stand in for one), and "self", the served model's first --self-layers layers under
the client's head:

  tok_s          delay -> drafter -> prompt: tokens/s after the first token ("plain": no drafts)
  speedup        delay -> drafter -> prompt: tok_s over plain's
  acceptance     delay -> drafter -> prompt: accepted drafts / drafted ones
  mean_accepted  delay -> drafter -> prompt: accepted drafts per verification step
  tokens_equal   every session's tokens, plain and speculative, equal local transformers' greedy tokens

Prompts, through the model's chat template: "essay" (a short essay, little to copy) and "edit" (rewrite a given
paragraph changing one word, where lookup should accept long runs).

    sudo .venv/bin/python scripts/bench_spec.py --json spec.json      # default model, delays 0 25 50 ms
    sudo .venv/bin/python scripts/bench_spec.py --quick               # tiny model, delays 0 10 ms (CI)
    sudo .venv/bin/python scripts/bench_spec.py --delays-ms 25 --drafters model self   # a part of it
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from bench_e2e import local_decode  # noqa: E402
from bench_wan import MBIT, STEP_TIMEOUT_S, Worker, decode_tok_s, greedy, grid_swarm, log, worker  # noqa: E402

from client import SwarmClient  # noqa: E402
from client.config import ClientConfig  # noqa: E402
from client.draft_model import DraftModel, load_draft_model  # noqa: E402
from client.drafting import make_speculation  # noqa: E402
from client.generation import generate_ids, speculative_ids  # noqa: E402
from swarm.codec import ActivationConfig  # noqa: E402
from swarm.models import ModelSource, Sampler, SamplingParams, resolve_model  # noqa: E402
from swarm.models.heap import freeze_loaded  # noqa: E402
from swarm.testing.prompts import chat_prompt_ids  # noqa: E402
from swarm.testing.wan import LinkSpec  # noqa: E402
from swarm.testing.wan.bench import bench_main  # noqa: E402

DRAFTERS = ("lookup", "model", "self")
ESSAY = "Write a short essay about the history of the bicycle."
PARAGRAPH = (
    "The bicycle changed how ordinary people moved through their towns and cities. Before the bicycle, a worker "
    "who lived far from the factory had to walk for an hour or pay for a seat on a crowded tram. With a bicycle, "
    "the same trip took a quarter of the time and cost nothing once the machine was bought. Women found in the "
    "bicycle a new kind of freedom: they could ride out alone, and the long skirts of the day soon gave way to "
    "clothes that suited riding. Doctors at first warned that the bicycle would ruin the health of its riders, "
    "but within a few years they were recommending it as exercise. Road clubs formed, maps were printed for "
    "riders, and many of the smooth roads we drive on today were first paved because people on a bicycle asked "
    "for them. Few machines have done so much with so little."
)
EDIT = f"Rewrite this paragraph, changing only 'bicycle' to 'bike':\n\n{PARAGRAPH}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0, 25, 50])
    p.add_argument("--bandwidth-mbit", type=float, default=1000)
    p.add_argument("--new-tokens", type=int, default=96, help="decode tokens per session")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[4, 8], help="lookup's fixed draft lengths")
    p.add_argument("--auto-k", type=int, default=8, help="most drafts a step of the adaptive length")
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS, help="drafters to run")
    p.add_argument("--repeats", type=int, default=1, help="sessions per point; the fastest counts")
    p.add_argument("--prompts", nargs="+", default=["essay", "edit"], choices=["essay", "edit"])
    p.add_argument("--self-layers", type=int, default=27, help="layers the self drafter drafts with")
    p.add_argument("--prefix", default="fsb", help="name prefix of the benchmark's namespaces and devices")
    p.add_argument("--peer-args", default="", help="extra swarm-peer join arguments")
    p.add_argument("--json", help="also write the JSON object here")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, delays 0 and 10 ms, few tokens (a smoke test)"
    )
    p.add_argument("--activations", default="exact", choices=["exact"], help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.delays_ms, args.new_tokens, args.draft_tokens, args.auto_k, args.self_layers = (
            "tiny",
            [0, 10],
            16,
            [4],
            4,
            3,
        )
    return args


# --- the client process, on its own host ---------------------------------------------------------------------


async def _session(client: SwarmClient, order: dict[str, Any], draft: DraftModel | None) -> dict[str, Any]:
    """One greedy session as the order says: tokens, their arrival times, the speculation's counters and
    its steps after the prompt's as [tokens, ms, drafted, kept]."""
    ids, new_tokens = order["ids"], order["new_tokens"]
    spec = make_speculation(order["speculate"], order["draft_tokens"], draft)
    steps: list[list[float]] = []
    if spec is not None:
        if not order["adaptive"]:
            spec.length = None  # always draft_tokens where the drafter has them
        observe = spec.observe

        def logged(tokens: int, seconds: float, drafted: int, kept: int) -> None:
            steps.append([tokens, round(seconds * 1e3, 1), drafted, kept])
            observe(tokens, seconds, drafted, kept)

        spec.observe = logged  # type: ignore[method-assign]
    pick = Sampler(SamplingParams()).sample
    session = client.aclient.new_session(len(ids) + new_tokens)
    tokens, times = [], [time.perf_counter()]
    try:
        request = greedy(ids, new_tokens)
        if spec is None:
            stream = generate_ids(session, request, pick, argmax_only=True)
        else:
            stream = speculative_ids(session, request, pick, spec, argmax_only=True)
        async with aclosing(stream) as tokens_of:
            async for token in tokens_of:
                times.append(time.perf_counter())
                tokens.append(token)
    finally:
        await session.close()
    counters = {"steps": spec.steps, "drafted": spec.drafted, "accepted": spec.accepted} if spec else None
    return {"tokens": tokens, "times": times, "speculation": counters, "steps": steps}


def worker_main(initial_peers: Sequence[str], model: str) -> None:
    """Connect, say ready, then answer one order line at a time until stdin ends."""
    codec = ActivationConfig(mode="exact")
    drafts: dict[str, DraftModel | None] = {}  # by the order's settings: each draft model loaded once
    with SwarmClient(initial_peers, model=model, step_timeout_s=STEP_TIMEOUT_S, activations=codec) as client:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            order = json.loads(line)
            key = json.dumps(order["draft"], sort_keys=True)
            if key not in drafts:
                config = ClientConfig(**order["draft"])
                head, tokenizer = client.aclient.head, client.tokenizer
                drafts[key] = load_draft_model(config, resolve_model(model), head, tokenizer)
                freeze_loaded()  # as the client does with what it loads before connecting
            print(json.dumps(client.run(_session(client, order, drafts[key]))), flush=True)


def ask(
    w: Worker,
    ids: Sequence[int],
    new_tokens: int,
    speculate: str,
    draft_tokens: int,
    adaptive: bool = False,
    draft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``draft``: the ClientConfig settings of the model drafter "model" or "self" drafts with."""
    order = {"ids": list(ids), "new_tokens": new_tokens, "speculate": speculate, "draft_tokens": draft_tokens}
    return dict(w.ask(order | {"adaptive": adaptive, "draft": draft or {}}))


def drafter_runs(args: argparse.Namespace) -> dict[str, tuple[str, int, bool, dict[str, Any]]]:
    """name -> (speculate, most drafts a step, adaptive, the draft model's settings) of each session with
    drafts: lookup's fixed lengths, then the client's adaptive length (client.drafting.DraftLength) with
    each drafter."""
    runs: dict[str, tuple[str, int, bool, dict[str, Any]]] = {}
    if "lookup" in args.drafters:
        runs |= {f"lookup-k{k}": ("lookup", k, False, {}) for k in args.draft_tokens}
        runs["lookup-auto"] = ("lookup", args.auto_k, True, {})
    if "model" in args.drafters:
        runs["model"] = ("model", args.auto_k, True, {"speculate": "model", "draft_model": args.model})
    if "self" in args.drafters:
        runs["self"] = ("self", args.auto_k, True, {"speculate": "self", "draft_layers": args.self_layers})
    return runs


# --- the measurements ---------------------------------------------------------------------------------------


def prompts(source: ModelSource) -> dict[str, list[int]]:
    essay, edit = chat_prompt_ids(source, ESSAY), chat_prompt_ids(source, EDIT)
    if source.tokenizer() is None:  # the tiny model: fixed ids, so make the edit prompt repeat itself
        edit = edit[:8] * 4
    return {"essay": essay, "edit": edit}


def measure(
    w: Worker,
    net: Any,
    args: argparse.Namespace,
    prompt_ids: dict[str, list[int]],
    local: dict[str, list[int]],
    drafters: dict[str, tuple[str, int, bool, dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, bool], dict[str, Any]]:
    """tok_s and the speculation's counters by delay, drafter and prompt (the fastest of --repeats sessions
    each), whether each one's tokens equal transformers', and the steps of each fastest session."""
    tok_s: dict[str, dict[str, dict[str, float]]] = {}
    counters: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    equal: dict[str, bool] = {}
    step_log: dict[str, list[list[float]]] = {}
    for delay_ms in sorted(args.delays_ms):
        net.set_all(LinkSpec(delay_ms / 1000, args.bandwidth_mbit * MBIT))
        d = f"{delay_ms:g}"
        for name, ids in prompt_ids.items():
            runs = {"plain": ("off", 1, False, {})} | drafters
            for drafter, (speculate, k, adaptive, draft) in runs.items():
                sessions = [
                    ask(w, ids, args.new_tokens, speculate, k, adaptive, draft) for _ in range(args.repeats)
                ]
                best = max(sessions, key=lambda one: decode_tok_s(one["times"]))
                tok_s.setdefault(d, {}).setdefault(drafter, {})[name] = decode_tok_s(best["times"])
                if drafter != "plain":
                    counters.setdefault(d, {}).setdefault(drafter, {})[name] = best["speculation"]
                    step_log[f"{d}/{drafter}/{name}"] = best["steps"]
                equal[f"{d}/{drafter}/{name}"] = all(one["tokens"] == local[name] for one in sessions)
            log(f"{d} ms, {name}: " + ", ".join(f"{k} {v[name]:.2f}" for k, v in tok_s[d].items()))
    return tok_s, counters, equal, step_log


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    source = resolve_model(args.model)
    prompt_ids = {name: ids for name, ids in prompts(source).items() if name in args.prompts}
    reference = source.load_reference_model("cpu", "float32")
    local = {name: local_decode(reference, ids, args.new_tokens)[1] for name, ids in prompt_ids.items()}
    del reference
    drafters = drafter_runs(args)
    with tempfile.TemporaryDirectory(prefix="flowswarm-spec-") as tmp:
        with grid_swarm(args, Path(tmp), args.prefix) as (net, swarm):
            with worker(swarm, "client", swarm.initial_peers, args, script=__file__) as w:
                first = next(iter(prompt_ids.values()))
                ask(w, first, 2, "off", 1)  # warm: routes, connections, the peers' first calls
                # and each draft model: loaded, its cache made
                for speculate, k, _, draft in drafters.values():
                    ask(w, first, 4, speculate, k, False, draft)
                tok_s, counters, equal, step_log = measure(w, net, args, prompt_ids, local, drafters)
    report = _report(tok_s, counters)
    return report | {
        "tokens_equal": all(equal.values()),
        "tokens_equal_by": equal,
        "steps": step_log,
        "model": args.model,
        "delays_ms": args.delays_ms,
        "bandwidth_mbit": args.bandwidth_mbit,
        "new_tokens": args.new_tokens,
        "drafters": {
            name: [speculate, k, adaptive, draft]
            for name, (speculate, k, adaptive, draft) in drafters.items()
        },
        "peer_args": args.peer_args,
        "prompt_tokens": {name: len(ids) for name, ids in prompt_ids.items()},
        "total_s": round(time.perf_counter() - began, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _report(
    tok_s: dict[str, dict[str, dict[str, float]]], counters: dict[str, dict[str, dict[str, dict[str, int]]]]
) -> dict[str, Any]:
    return {
        "tok_s": {
            d: {k: {p: round(v, 2) for p, v in row.items()} for k, row in by.items()}
            for d, by in tok_s.items()
        },
        "speedup": {
            d: {
                k: {p: _ratio(v, by["plain"][p]) for p, v in row.items()}
                for k, row in by.items()
                if k != "plain"
            }
            for d, by in tok_s.items()
        },
        "acceptance": {
            d: {k: {p: _ratio(c["accepted"], c["drafted"]) for p, c in row.items()} for k, row in by.items()}
            for d, by in counters.items()
        },
        "mean_accepted": {
            d: {k: {p: _ratio(c["accepted"], c["steps"]) for p, c in row.items()} for k, row in by.items()}
            for d, by in counters.items()
        },
        "speculation": counters,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.worker:
        worker_main(args.initial_peers, args.model)
        return
    bench_main("bench_spec", lambda: run(args), args.json)


if __name__ == "__main__":
    main()
