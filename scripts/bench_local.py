#!/usr/bin/env python
"""Local benchmark of the model layer: load times and split-vs-transformers decode/prefill speed.

Prints ONE JSON object:
  cold_load_s         resolve + load 3 block ranges + head into a FRESH cache dir (includes GGUF conversion)
  warm_load_s         the same again from the converted cache, best of 2 (python imports excluded); the
                      default model's target is under 3 s
  local_*_tok_s       transformers generate with its own KV cache (greedy)
  split_*_tok_s       our BlockRanges [0,a) [a,b) [b,N) + ClientHead in this process, same prompt, greedy,
                      through the client's own path (client.local: InferenceSession and decode loop)
  tokens_match        whether the split run's tokens equal transformers' in every repeat
Prefill tok/s = prompt tokens / time to the first new token; decode tok/s = (new tokens - 1) / time after it.
Each figure is the best of --repeats runs (the machine is shared and noisy). Runs with 1 torch thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

PARAGRAPH = (
    "Paris has been the capital of France for most of the last thousand years. The city grew on both banks of "
    "the Seine around the Ile de la Cite, where the cathedral of Notre-Dame stands. In the nineteenth century "
    "Baron Haussmann rebuilt much of the centre with wide boulevards, parks and a new sewer system, and the "
    "Eiffel Tower was built for the World's Fair of 1889. "
)


def prompt_ids(source, prompt_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    tokenizer = source.tokenizer()
    if tokenizer is None:  # tiny model: no tokenizer, any ids will do
        return [(7 * i + 3) % source.spec.vocab_size for i in range(prompt_tokens)]
    text = PARAGRAPH * (prompt_tokens // 60 + 1)
    ids = tokenizer(text)["input_ids"][: prompt_tokens - 12]
    question = tokenizer.decode(ids) + "\nSummarize this in one sentence."
    messages = [{"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


def load_all(model: str):  # type: ignore[no-untyped-def]
    from swarm.models import resolve_model

    began = time.perf_counter()
    source = resolve_model(model)
    n = source.spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    blocks = [source.load_blocks(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    head = source.load_head()
    return source, blocks, head, time.perf_counter() - began


class Stamps:
    """A generate() streamer that records when each put() happens: first the prompt, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.tokens.extend(value.flatten().tolist())

    def end(self) -> None:
        pass


def run_local(reference, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:  # type: ignore[no-untyped-def]
    reference.generation_config.eos_token_id = None  # generate all new_tokens, like the split run
    stamps = Stamps()
    x = torch.tensor([ids])
    reference.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False, streamer=stamps
    )
    prefill_s = stamps.times[1] - stamps.times[0]
    decode_s = stamps.times[-1] - stamps.times[1]
    return prefill_s, decode_s, stamps.tokens


def run_split(blocks, head, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:  # type: ignore[no-untyped-def]
    from client.generation import GenerationRequest, timed_ids
    from client.local import in_process_client
    from swarm.models import Sampler, SamplingParams

    client = in_process_client(head, {f"peer-{i}": block for i, block in enumerate(blocks)})
    request = GenerationRequest(tuple(ids), new_tokens, eos_ids=frozenset())  # EOS ignored, like run_local

    async def run() -> tuple[list[int], list[float]]:
        session = client.new_session(len(ids) + new_tokens)
        try:
            return await timed_ids(session, request, Sampler(SamplingParams()).sample)
        finally:
            await session.close()

    tokens, times = asyncio.run(run())
    return times[1] - times[0], times[-1] - times[1], tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--json", action="store_true", help="accepted for symmetry; the output is always JSON"
    )
    parser.add_argument("--model", default="default", help="default | tiny[:SEED] | path to an HF dir")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300, help="approximate prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    fresh_cache = tempfile.mkdtemp(prefix="flowswarm-bench-")
    saved_cache = os.environ.get("FLOWSWARM_CACHE")
    os.environ["FLOWSWARM_CACHE"] = fresh_cache
    try:
        cold_source, *_, cold_load_s = load_all(args.model)
        warm_load_s = min(load_all(args.model)[3] for _ in range(2))
    finally:
        shutil.rmtree(fresh_cache, ignore_errors=True)
        if saved_cache is None:
            del os.environ["FLOWSWARM_CACHE"]
        else:
            os.environ["FLOWSWARM_CACHE"] = saved_cache

    source, blocks, head, _ = load_all(args.model)  # from the regular cache, for the speed runs
    reference = source.load_reference_model()
    ids = prompt_ids(source, args.prompt_tokens)
    best = {"local_prefill": 0.0, "local_decode": 0.0, "split_prefill": 0.0, "split_decode": 0.0}
    tokens_match = True
    for repeat in range(args.repeats):
        # alternate which side goes first, so neither always runs right after the other's cache warm-up
        order = ["local", "split"] if repeat % 2 == 0 else ["split", "local"]
        results = {}
        for name in order:
            if name == "local":
                results[name] = run_local(reference, ids, args.new_tokens)
            else:
                results[name] = run_split(blocks, head, ids, args.new_tokens)
        for name, (prefill_s, decode_s, _tokens) in results.items():
            best[f"{name}_prefill"] = max(best[f"{name}_prefill"], len(ids) / prefill_s)
            best[f"{name}_decode"] = max(best[f"{name}_decode"], (args.new_tokens - 1) / decode_s)
        tokens_match &= results["local"][2] == results["split"][2]

    report = {
        "model": source.spec.name,
        "cold_load_s": round(cold_load_s, 2),
        "warm_load_s": round(warm_load_s, 2),
        "local_decode_tok_s": round(best["local_decode"], 1),
        "split_decode_tok_s": round(best["split_decode"], 1),
        "local_prefill_tok_s": round(best["local_prefill"], 1),
        "split_prefill_tok_s": round(best["split_prefill"], 1),
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "tokens_match": tokens_match,
        # a fresh conversion must give the same hash, or peers converting independently would disagree
        "weights_hash_reproducible": cold_source.spec.weights_hash == source.spec.weights_hash,
        "threads": torch.get_num_threads(),
    }
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
