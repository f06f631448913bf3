"""The GPU path (`swarm-peer join --device cuda`): three peers on the GPU answer exactly like transformers there.

Skipped where torch sees no CUDA device, as on the CI machine; `scripts/check_cuda` runs it on a GPU machine.
float32 throughout: exactness, not speed (bench_e2e.py --device cuda --dtype bfloat16 measures speed).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from client import SwarmClient
from swarm.models import ModelSource, SamplingParams
from swarm.testing import LocalSwarm
from swarm.testing.reference import greedy_tokens

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW_TOKENS = 24
# prompts prefilled in chunks of 16 tokens: the chat prompt (37 tokens) covers chunked prefill on the GPU too
ON_GPU = [
    "--no-follow-plan",
    "--device",
    "cuda",
    "--dtype",
    "float32",
    "--executor-prefill-chunk-tokens",
    "16",
]


@pytest.fixture(scope="module")
def reference(default_source: ModelSource) -> object:
    return default_source.load_reference_model("cuda")


@pytest.fixture(scope="module")
def gpu_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("gpu_swarm"), model="default") as swarm:
        swarm.start_peer(layers="0:10", name="first", extra_args=ON_GPU)
        swarm.start_peer(layers="10:20", name="middle", wait=False, extra_args=ON_GPU)
        swarm.start_peer(layers="20:30", name="last", wait=False, extra_args=ON_GPU)
        swarm.wait_all_ready(timeout_s=180)
        yield swarm


def test_the_chat_answer_through_gpu_peers_equals_transformers_on_the_gpu(
    gpu_swarm: LocalSwarm, default_source: ModelSource, reference: object
) -> None:
    tokenizer = default_source.tokenizer()
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to("cuda")
    with torch.inference_mode():  # generate stops at the end of the answer, as the client does
        out = reference.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)  # type: ignore[attr-defined]
    expected = str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert "Paris" in expected
    with SwarmClient(gpu_swarm.initial_peers, model="default", device="cuda") as client:
        assert client.generate(messages=QUESTION, max_new_tokens=MAX_NEW_TOKENS) == expected


def test_many_generations_at_once_batched_on_the_gpu_stay_exact(
    gpu_swarm: LocalSwarm, reference: object
) -> None:
    """Six sessions of one client: their decode steps share forward calls on each GPU peer."""
    rng = random.Random(11)
    rows = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    new_tokens = 12
    with SwarmClient(gpu_swarm.initial_peers, model="default", device="cuda") as client:
        got = client.generate_ids_batch(rows, new_tokens, SamplingParams())
        head, eos = client.aclient.batcher, client.aclient.eos_ids
    for prompt, tokens in zip(rows, got, strict=True):
        want = greedy_tokens(reference, prompt, new_tokens)
        assert tokens == want[: len(tokens)] and (len(tokens) == new_tokens or want[len(tokens)] in eos)
    assert head.rows / head.calls > 1, "rounds should batch the sessions"
