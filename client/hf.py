"""A transformers-style model object for people who already call `model.generate(input_ids, ...)`.

    from client.hf import SwarmModelForCausalLM
    model = SwarmModelForCausalLM.from_swarm(initial_peers=[...])
    ids = model.tokenizer("What is the capital of France?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20)          # LongTensor [1, prompt + new], like transformers
    print(model.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

Only generation is offered (no forward() returning logits for training): the swarm keeps no gradients.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from client.client import SwarmClient
from swarm.models.head import SamplingParams


class IdsClient(Protocol):
    """What the model object needs of a client; SwarmClient has it."""

    @property
    def tokenizer(self) -> Any: ...

    def generate_ids_batch(
        self,
        rows: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams,
        yield_eos: bool = False,
    ) -> list[list[int]]: ...  # one list of new ids per row, the rows generated concurrently

    def close(self) -> None: ...


class SwarmModelForCausalLM:
    """`generate` with transformers' argument names and output layout, over a SwarmClient."""

    def __init__(self, client: IdsClient) -> None:
        self.client = client

    @classmethod
    def from_swarm(
        cls, initial_peers: Sequence[str], model: str | None = None, **config_fields: Any
    ) -> SwarmModelForCausalLM:
        return cls(SwarmClient(initial_peers, model, **config_fields))

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 50,
        repetition_penalty: float = 1.0,
        pad_token_id: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """input_ids [B, L] (left padding allowed, with attention_mask) -> LongTensor [B, L + new].

        As in transformers: greedy unless do_sample; a row that ends early (EOS, kept in the output) is
        padded on the right with pad_token_id (the tokenizer's pad, else its EOS).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype != torch.long:
            raise ValueError("input_ids must be a LongTensor [batch, length]")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape")
        params = SamplingParams(
            temperature=temperature if do_sample else 0.0,
            top_k=top_k if do_sample else 0,
            top_p=top_p if do_sample else 1.0,
            repetition_penalty=repetition_penalty,
            seed=secrets.randbits(63) if seed is None else seed,
        )
        prompts = [
            (input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]).tolist()
            for b in range(input_ids.shape[0])
        ]
        # the rows run as concurrent sessions: the peers batch their decode steps, the client its LM head
        rows = self.client.generate_ids_batch(prompts, max_new_tokens, params, yield_eos=True)
        pad = pad_token_id if pad_token_id is not None else _pad_id(self.tokenizer)
        width = max(len(r) for r in rows)
        new = torch.full((len(rows), width), pad, dtype=torch.long)
        for b, r in enumerate(rows):
            new[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        return torch.cat([input_ids, new], dim=1)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> SwarmModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0
