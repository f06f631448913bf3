"""Exactness of our split execution against transformers on the real default model (SmolLM2-135M, fp32).

Generation goes through the client's own path (client.local's in-process chain: InferenceSession and decode
loop), so these tests check the blocks and the client's use of them together. How fast a warm load is belongs
to scripts/bench_local.py (`warm_load_s`), not to a test.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from client.local import in_process_client
from swarm.models import SamplingParams, Step, resolve_model
from swarm.models.backends.cpu import int4
from swarm.models.backends.cpu.matmul import PACKED_TIMED_ROWS, Forms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPLITS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module", params=["measured", "int4"])
def parts(default_source, request):  # type: ignore[no-untyped-def]
    """The head and three ranges, multiplying as calibration chose, or through the 4-bit form (swarm.models.backends.cpu.int4:
    the default model's layers are GGUF Q4_1) for every input, prefill included."""
    head = default_source.load_head()
    blocks = [default_source.load_blocks(a, b) for a, b in SPLITS]
    if request.param == "int4":
        if not int4.available():
            pytest.skip("no 4-bit kernel here (needs x86-64 AVX2 and a C compiler)")
        for block in blocks:
            block.kernels.use_forms(
                Forms(packer="int4", packed_rows=frozenset(PACKED_TIMED_ROWS), packed_beyond=True)
            )
            assert block.kernels.forms.packer == "int4"  # taken: every weight of the model's layers is 4-bit
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
            expected = out.hidden_states[end][0]
            # to float rounding of the largest state (225 after 10 layers, 24827 after 20): another order of
            # the sums, as any form but F.linear's takes, moves the outputs by up to ~4e-6 of it
            assert (hidden - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert (head.logits(hidden) - out.logits[0]).abs().max().item() <= 1e-3


def test_greedy_generation_matches_transformers(parts, reference, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    _, head, blocks = parts
    ids = torch.tensor([prompt_ids])
    # eos disabled so that both sides produce all 32 tokens (a client without a tokenizer knows no EOS)
    reference.generation_config.eos_token_id = (
        None  # (None in generate()'s kwargs would mean "model default")
    )
    expected = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
    )
    expected_new = expected[0, len(prompt_ids) :].tolist()
    client = in_process_client(head, _named(blocks))
    got = asyncio.run(client.generate_ids(prompt_ids, 32, SamplingParams()))
    assert len(expected_new) == 32
    assert got == expected_new
    assert all(not block.active_sessions for block in blocks)  # the session was closed on every range


def test_answers_paris(parts) -> None:  # type: ignore[no-untyped-def]
    source, head, blocks = parts
    client = in_process_client(head, _named(blocks), source.tokenizer())
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = asyncio.run(client.generate(messages=question, max_new_tokens=16))
    assert "Paris" in answer


def test_spec_describes_smollm2(default_source) -> None:  # type: ignore[no-untyped-def]
    spec = default_source.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert spec.vocab_size == 49152 and spec.family == "llama" and len(spec.weights_hash) == 64


def test_a_warm_load_gives_the_same_model(default_source) -> None:  # type: ignore[no-untyped-def]
    """Resolving again reads the converted cache: same spec and hash, every range and the head load."""
    source = resolve_model("default")
    blocks = [source.load_blocks(a, b) for a, b in SPLITS]
    head = source.load_head()
    assert source.spec == default_source.spec
    assert [(b.range.start, b.range.end) for b in blocks] == SPLITS
    assert head.spec == default_source.spec


def _named(blocks):  # type: ignore[no-untyped-def]
    return {f"peer-{i}": block for i, block in enumerate(blocks)}
