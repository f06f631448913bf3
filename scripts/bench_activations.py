#!/usr/bin/env python
"""What the activation codecs (swarm/codec.py) cost on real hidden states, measured in one process. Prints JSON.

    .venv/bin/python scripts/bench_activations.py --json OUT      # the default model, 3 stages x 10 layers
    .venv/bin/python scripts/bench_activations.py --quick --json OUT   # the tiny model (the smoke test's)

The model's layers are split into ``--stages`` consecutive ranges, as peers of a swarm would hold them, and run
here; a codec is applied to the hidden states wherever they would cross a link: client -> first stage, between
stages, last stage -> client (``links: all``), or only between stages (``links: between_stages``, where the
client keeps its own links exact). Per codec:

    bytes_per_token     one token's hidden state on the wire (the encoded data, scales included)
    boundaries          for the states at each link (after layer 0 = the embeddings, ..., after the last
                        layer), the relative error ||decoded - sent|| / ||sent|| per token: max and mean over
                        the tokens of every prompt
    tokens              greedy decoding of ``--new-tokens`` after the chat prompt, with the KV cache as a peer
                        keeps it, the codec on every link: whether the tokens equal the exact run's, and the
                        index of the first that differs (null if none); ``forced_agreement``: over every
                        prompt, the exact run's tokens fed on, the share of steps whose argmax is the exact
                        one; the same with the codec between stages only

``exact_equals_reference``: the exact run's tokens equal local transformers' (the plainest reference; null for
a 16-bit ``--dtype``, which is not expected to).
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from swarm.codec import CODECS, relative_errors, round_trip
from swarm.models.blocks import BlockRange, Step
from swarm.models.head import ClientHead
from swarm.models.kv_cache import BLOCK_TOKENS
from swarm.models.loading import ModelSource, resolve_model
from swarm.testing.prompts import QUESTION, chat_prompt_ids
from swarm.testing.reference import greedy_reference
from swarm.wire import encode_hidden

QUESTIONS = (
    QUESTION,
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
)


def _stages(source: ModelSource, count: int, max_length: int, dtype: str) -> list[BlockRange]:
    layers = source.spec.num_layers
    cuts = [round(i * layers / count) for i in range(count + 1)]
    cache_tokens = -(-max_length // BLOCK_TOKENS) * BLOCK_TOKENS  # the cache holds whole blocks
    return [
        source.load_blocks(a, b, dtype=dtype, cache_tokens=cache_tokens)
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]


def _wire_bytes(codec: str, hidden: torch.Tensor) -> float:
    body = encode_hidden(hidden, codec)  # the data, and q8's scales, peaks and their indexes
    return sum(len(v) for v in body.values() if isinstance(v, bytes | memoryview)) / hidden.shape[0]


def _boundary_states(head: ClientHead, stages: list[BlockRange], ids: list[int]) -> list[torch.Tensor]:
    """The states at each link of one prompt's exact prefill: the embeddings, then each stage's output."""
    states = [
        head.embed(torch.tensor(ids)).to(stages[0].dtype)
    ]  # sent in the swarm's dtype, as a client does
    for blocks in stages:
        states.append(blocks.forward([Step(None, states[-1], blocks.range.start, blocks.range.end, 0)])[0])
    return states


def _boundary_errors(
    head: ClientHead, stages: list[BlockRange], prompts: list[list[int]]
) -> dict[str, dict[str, dict[str, float]]]:
    """codec -> "after layer N" -> {max, mean} of the per-token relative error over all prompts."""
    states = [_boundary_states(head, stages, ids) for ids in prompts]
    bounds = [0] + [blocks.range.end for blocks in stages]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for codec in CODECS:
        out[codec] = {}
        for i, layer in enumerate(bounds):
            errors = torch.cat([relative_errors(s[i], round_trip(s[i], codec)) for s in states])
            out[codec][f"after_layer_{layer}"] = {"max": float(errors.max()), "mean": float(errors.mean())}
    return out


def _generate(
    head: ClientHead,
    stages: list[BlockRange],
    ids: list[int],
    new_tokens: int,
    codec: str,
    all_links: bool,
    forced: list[int] | None = None,
) -> list[int]:
    """Greedy tokens through the stages with their KV caches, ``codec`` applied on each link it covers. With
    ``forced`` (teacher forcing), each step feeds the forced token on, whatever the argmax was."""
    session = secrets.token_hex(8)
    for blocks in stages:
        blocks.open_session(session, len(ids) + new_tokens)
    try:
        tokens: list[int] = []
        step_ids, position = list(ids), 0
        for _ in range(new_tokens):
            hidden = head.embed(torch.tensor(step_ids)).to(stages[0].dtype)
            for i, blocks in enumerate(stages):
                if all_links or i > 0:  # the link into this stage
                    hidden = round_trip(hidden, codec)
                hidden = blocks.forward(
                    [Step(session, hidden, blocks.range.start, blocks.range.end, position)]
                )[0]
            if all_links:  # the link back to the client
                hidden = round_trip(hidden, codec)
            tokens.append(int(head.logits(hidden[-1:].float())[0].argmax()))
            position += len(step_ids)
            step_ids = [forced[len(tokens) - 1]] if forced is not None else tokens[-1:]
        return tokens
    finally:
        for blocks in stages:
            blocks.close_session(session)


def _divergence(tokens: list[int], exact: list[int]) -> dict[str, Any]:
    first = next((i for i, (a, b) in enumerate(zip(tokens, exact, strict=True)) if a != b), None)
    return {"equal": first is None, "first_divergence": first}


def _tokens(
    head: ClientHead,
    stages: list[BlockRange],
    prompts: list[list[int]],
    exact: list[list[int]],
    codec: str,
    all_links: bool,
) -> dict[str, Any]:
    """Free-running greedy tokens after the first prompt against the exact ones; and over every prompt, with
    the exact tokens forced, the share of steps whose argmax is the exact one (a near tie flips a free run for
    good; forced, each step counts alone)."""
    new_tokens = len(exact[0])
    if codec == "exact":
        return _divergence(exact[0], exact[0]) | {"forced_agreement": 1.0}
    free = _generate(head, stages, prompts[0], new_tokens, codec, all_links)
    agree = 0
    for ids, want in zip(prompts, exact, strict=True):
        got = _generate(head, stages, ids, new_tokens, codec, all_links, forced=want)
        agree += sum(a == b for a, b in zip(got, want, strict=True))
    return _divergence(free, exact[0]) | {"forced_agreement": agree / (new_tokens * len(prompts))}


def run(model: str, stages_count: int, new_tokens: int, reference: bool, dtype: str) -> dict[str, Any]:
    torch.manual_seed(0)
    began = time.perf_counter()
    source = resolve_model(model)
    head = source.load_head()
    prompts = [chat_prompt_ids(source, q) for q in QUESTIONS]
    stages = _stages(source, stages_count, max(len(p) for p in prompts) + new_tokens, dtype)
    errors = _boundary_errors(head, stages, prompts)
    ids = prompts[0]
    exact = [_generate(head, stages, p, new_tokens, "exact", True) for p in prompts]
    sample = head.embed(torch.tensor(ids)).to(stages[0].dtype)
    codecs: dict[str, Any] = {}
    for codec in CODECS:
        codecs[codec] = {
            "bytes_per_token": _wire_bytes(codec, sample),
            "boundaries": errors[codec],
            "tokens": {
                "links_all": _tokens(head, stages, prompts, exact, codec, True),
                "between_stages": _tokens(head, stages, prompts, exact, codec, False),
            },
        }
    return {
        "model": source.spec.name,
        "dtype": str(stages[0].dtype).removeprefix("torch."),
        "hidden_size": source.spec.hidden_size,
        "stages": [str(blocks.range) for blocks in stages],
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": new_tokens,
        "codecs": codecs,
        # transformers runs float32: a 16-bit run's tokens are not expected to equal it
        "exact_equals_reference": (
            greedy_reference(source, ids, new_tokens) == exact[0]
            if reference and dtype == "float32"
            else None
        ),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write the JSON object here")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 8 tokens (the smoke test)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--stages", type=int, default=3, help="layer ranges, as peers would hold them")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-reference", action="store_true", help="skip the transformers reference run")
    parser.add_argument(
        "--dtype", default="float32", help="the stages' dtype (bfloat16: a GPU peer's; f16 is then exact)"
    )
    args = parser.parse_args()
    model, new_tokens = ("tiny", 8) if args.quick else (args.model, args.new_tokens)
    out = run(model, args.stages, new_tokens, not args.no_reference, args.dtype)
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
