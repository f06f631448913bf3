"""Greedy tokens of local transformers: what every answer through the swarm must equal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarm.models.loading import ModelSource


def greedy_tokens(model: Any, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
    """`new_tokens` argmax tokens after `prompt_ids`, each from a full forward of the sequence so far (no
    KV cache: the plainest reference there is)."""
    out = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(new_tokens):
            out.append(int(model(torch.tensor([out], device=model.device)).logits[0, -1].argmax()))
    return out[len(prompt_ids) :]


def greedy_reference(source: ModelSource, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy tokens of the whole model `source`, loaded as a plain transformers model."""
    return greedy_tokens(source.load_reference_model(), prompt_ids, new_tokens)
