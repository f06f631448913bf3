"""Generation through block ranges held in THIS process: the reference path for tests, the benchmark and the demo.

The swarm client does the same thing with the ranges on remote peers; here each hop is a direct call.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence

import torch

from swarm.models.blocks import BlockRange, Step
from swarm.models.head import ClientHead, Sampler, SamplingParams


class LocalPipeline:
    """A ClientHead plus BlockRanges that together cover all layers, in order."""

    def __init__(self, head: ClientHead, blocks: Sequence[BlockRange]) -> None:
        expected = 0
        for block in blocks:
            if block.range.start != expected:
                raise ValueError(
                    f"block ranges must chain from 0: expected one starting at {expected}, got {block.range}"
                )
            expected = block.range.end
        if expected != head.spec.num_layers:
            raise ValueError(f"block ranges end at layer {expected}, the model has {head.spec.num_layers}")
        self.head = head
        self.blocks = list(blocks)

    def hidden(self, hidden: torch.Tensor, session_id: str | None, position: int) -> torch.Tensor:
        """Run hidden [T, H] through every block; returns the last layer's output [T, H]."""
        for block in self.blocks:
            step = Step(
                session_id, hidden.to(block.device, block.dtype), block.range.start, block.range.end, position
            )
            hidden = block.forward([step])[0]
        return hidden

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        use_cache: bool = True,
        stop_token_ids: Sequence[int] = (),
    ) -> Iterator[int]:
        """Yield new token ids one by one. use_cache=False re-runs the whole prefix statelessly every step."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        sampler = Sampler(sampling or SamplingParams())
        tokens = list(prompt_ids)
        session_id = uuid.uuid4().hex if use_cache else None
        if session_id is not None:
            for block in self.blocks:
                block.open_session(session_id, len(tokens) + max_new_tokens)
        try:
            position, fresh = 0, tokens
            for _ in range(max_new_tokens):
                if session_id is None:
                    position, fresh = 0, tokens
                hidden = self.hidden(self.head.embed(torch.tensor(fresh)), session_id, position)
                token = sampler.sample(self.head.logits(hidden[-1]), tokens)
                position += len(fresh)
                tokens.append(token)
                fresh = [token]
                yield token
                if token in stop_token_ids:
                    return
        finally:
            if session_id is not None:
                for block in self.blocks:
                    block.close_session(session_id)
