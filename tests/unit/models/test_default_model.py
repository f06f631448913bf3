"""Exactness of our split execution against transformers on the real default model (SmolLM2-135M, fp32)."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.models import LocalPipeline, Step, resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPLITS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def parts(default_source):  # type: ignore[no-untyped-def]
    head = default_source.load_head()
    blocks = [default_source.load_blocks(a, b) for a, b in SPLITS]
    return default_source, head, blocks


@pytest.fixture(scope="module")
def reference(default_source):  # type: ignore[no-untyped-def]
    return default_source.load_reference_model()


@pytest.fixture(scope="module")
def prompt_ids(default_source) -> list[int]:  # type: ignore[no-untyped-def]
    tokenizer = default_source.tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def test_hidden_states_match_transformers(parts, reference, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    _, head, blocks = parts
    ids = torch.tensor(prompt_ids)
    with torch.no_grad():
        out = reference(ids[None], output_hidden_states=True)
    hidden = head.embed(ids)
    for block, (start, end) in zip(blocks, SPLITS, strict=True):
        hidden = block.forward([Step(None, hidden, start, end, 0)])[0]
        if end < 30:  # hidden_states[i] is the input of layer i
            assert (hidden - out.hidden_states[end][0]).abs().max().item() <= 1e-4
    assert (head.logits(hidden) - out.logits[0]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_matches_transformers(parts, reference, prompt_ids, use_cache) -> None:  # type: ignore[no-untyped-def]
    _, head, blocks = parts
    ids = torch.tensor([prompt_ids])
    # eos disabled so that both sides produce all 32 tokens
    reference.generation_config.eos_token_id = (
        None  # (None in generate()'s kwargs would mean "model default")
    )
    expected = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
    )
    expected_new = expected[0, len(prompt_ids) :].tolist()
    got = list(LocalPipeline(head, blocks).generate(prompt_ids, 32, use_cache=use_cache))
    assert len(expected_new) == 32
    assert got == expected_new


def test_answers_paris(parts, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    source, head, blocks = parts
    tokenizer = source.tokenizer()
    stop = [tokenizer.eos_token_id]
    tokens = list(LocalPipeline(head, blocks).generate(prompt_ids, 16, stop_token_ids=stop))
    answer = tokenizer.decode(tokens, skip_special_tokens=True)
    assert "Paris" in answer


def test_spec_describes_smollm2(default_source) -> None:  # type: ignore[no-untyped-def]
    spec = default_source.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert spec.vocab_size == 49152 and spec.family == "llama" and len(spec.weights_hash) == 64


def test_warm_load_is_fast(default_source) -> None:  # type: ignore[no-untyped-def]
    """Once converted, resolving and loading every layer + head takes well under 3 s (no GGUF, no rehash)."""
    began = time.perf_counter()
    source = resolve_model("default")
    blocks = [source.load_blocks(a, b) for a, b in SPLITS]
    source.load_head()
    assert time.perf_counter() - began <= 3.0
    assert source.spec == default_source.spec and len(blocks) == 3
