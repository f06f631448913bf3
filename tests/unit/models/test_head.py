"""ClientHead and Sampler."""

from __future__ import annotations

import pytest
import torch

from swarm.models import Sampler, SamplingParams

pytestmark = pytest.mark.timeout(30)


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert Sampler(SamplingParams()).sample(logits) == 1
    assert all(
        Sampler(SamplingParams(temperature=1.0, top_k=1, seed=s)).sample(logits) == 1 for s in range(5)
    )


def test_sampling_is_deterministic_per_seed() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    first = [Sampler(params).sample(logits) for _ in range(3)]
    sampler_a, sampler_b = Sampler(params), Sampler(params)
    seq_a = [sampler_a.sample(logits) for _ in range(20)]
    seq_b = [sampler_b.sample(logits) for _ in range(20)]
    assert seq_a == seq_b and len(set(first)) == 1
    other = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=43))
    assert [other.sample(logits) for _ in range(20)] != seq_a


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    assert {sampler.sample(logits) for _ in range(200)} == {0, 1}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.tensor([1.0, 0.9, -3.0])
    assert Sampler(SamplingParams(repetition_penalty=1.5)).sample(logits, [0]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.0)).sample(logits, [0]) == 0


def test_bad_sampling_params() -> None:
    for bad in ({"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1-D"):
        Sampler(SamplingParams()).sample(torch.zeros(2, 3))


def test_head_embeds_and_projects(tiny_source) -> None:  # type: ignore[no-untyped-def]
    head = tiny_source.load_head()
    hidden = head.embed(torch.tensor([0, 5, 319]))
    assert hidden.shape == (3, 64) and head.logits(hidden).shape == (3, 320)
    with pytest.raises(ValueError, match="token ids"):
        head.embed(torch.tensor([320]))
    with pytest.raises(ValueError, match="1-D integer"):
        head.embed(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="hidden size"):
        head.logits(torch.zeros(2, 63))


def test_tied_embeddings_share_the_matrix(default_source) -> None:  # type: ignore[no-untyped-def]
    head = default_source.load_head()
    assert head.lm_head_weight is head.embed_weight
