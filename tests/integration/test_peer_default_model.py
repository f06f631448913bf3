"""The real default model (SmolLM2-135M) on three forwarding peers: 16 greedy tokens equal local transformers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import torch

from swarm.models.loading import ModelSource, resolve_model
from swarm.testing import LocalSwarm, swarm_client
from swarm.transport import call_close, call_step
from swarm.wire import CloseRequest, Hop, StepRequest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def source() -> ModelSource:
    torch.set_num_threads(1)
    return resolve_model("default")


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, source: ModelSource
) -> Iterator[tuple[LocalSwarm, list[Hop]]]:
    n = source.spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    with LocalSwarm(tmp_path_factory.mktemp("default"), model="default") as local:
        extra = ["--cache-tokens", "1024", "--no-plan", "--no-follow-plan"]
        local.start_peer(f"{cuts[0]}:{cuts[1]}", name="d0", extra_args=extra)
        local.start_peer(f"{cuts[1]}:{cuts[2]}", name="d1", extra_args=extra, wait=False)
        local.start_peer(f"{cuts[2]}:{cuts[3]}", name="d2", extra_args=extra, wait=False)
        local.wait_all_ready(timeout_s=180)
        hops = [Hop(p.peer_id, tuple(p.maddrs), cuts[i], cuts[i + 1]) for i, p in enumerate(local.peers)]
        yield local, hops


def test_sixteen_greedy_tokens_equal_local_transformers(
    swarm: tuple[LocalSwarm, list[Hop]], source: ModelSource
) -> None:
    local, hops = swarm
    head = source.load_head()
    tokenizer = source.tokenizer()
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids[0]
    reference = source.load_reference_model()
    with torch.inference_mode():
        expected = reference.generate(
            prompt[None],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(prompt)[None],
        )[0, len(prompt) :].tolist()
    first, *rest = hops
    session = uuid.uuid4().hex
    max_length = len(prompt) + NEW_TOKENS

    async def generate() -> list[int]:
        out: list[int] = []
        async with swarm_client(local.initial_peers, source.spec.weights_hash) as (_dht, _directory, p2p):
            step_input, position = head.embed(prompt), 0
            for _ in range(NEW_TOKENS):
                request = StepRequest(
                    session,
                    position,
                    step_input,
                    first.start,
                    first.end,
                    max_length,
                    source.spec.weights_hash,
                    tuple(rest),
                )
                reply = await call_step(p2p, first.peer_id, request, maddrs=first.maddrs, timeout_s=60)
                position += step_input.shape[0]
                token = int(head.logits(reply.hidden)[-1].argmax())
                out.append(token)
                step_input = head.embed(torch.tensor([token]))
            await call_close(p2p, first.peer_id, CloseRequest(session, tuple(rest)), maddrs=first.maddrs)
        return out

    got = asyncio.run(generate())
    assert got == expected, f"swarm: {tokenizer.decode(got)!r}\nlocal: {tokenizer.decode(expected)!r}"
