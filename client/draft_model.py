"""Model drafters: a model on the client guesses the next tokens greedily, for the swarm to verify.

Two kinds share one class. ``speculate = "model"``: a whole small model (``draft_model``) that shares the
served model's tokenizer, with its own embeddings and head. ``speculate = "self"``: the served model's own first
``draft_layers`` layers, read from its checkpoint, topped with the client's final norm and head (no sibling
needed, but a weaker guess). Either way the layers run in a BlockRange, the in-process path the peers use (on a
CPU, the 4-bit kernels), far faster as a drafter than a transformers model.

Every session's drafter keeps a KV cache in that range, in step with the tokens it has seen: each proposal cuts
the cache back to where it agrees with the session's history (rejected drafts drop out there), runs only the
tokens after that point, then drafts k tokens one at a time.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

import torch

from client.config import ClientConfig
from swarm.errors import SessionEvicted, SwarmError
from swarm.models.blocks import BlockRange, Step
from swarm.models.head import ClientHead
from swarm.models.loading import ModelSource, resolve_model

logger = logging.getLogger(__name__)


class DraftModel:
    """Layers [0, n) of a model and a head on the client: the weights every session's drafter shares. Like a
    BlockRange, used from one thread (the client's event loop)."""

    def __init__(self, blocks: BlockRange, head: ClientHead) -> None:
        if blocks.range.start != 0:
            raise ValueError(f"a draft model starts at layer 0, got layers {blocks.range}")
        if blocks.spec.hidden_size != head.spec.hidden_size:
            raise ValueError(
                f"draft layers of hidden size {blocks.spec.hidden_size} under a head of {head.spec.hidden_size}"
            )
        self.blocks = blocks
        self.head = head

    @property
    def layers(self) -> int:
        return self.blocks.range.end

    def drafter(self) -> ModelDrafter:
        """A drafter for one session, with a cache of its own in these layers."""
        return ModelDrafter(self)

    @torch.no_grad()
    def run(self, session_id: str, token_ids: Sequence[int], position: int) -> int:
        """``token_ids`` into the session's cache from ``position`` on: the greedy next token after them."""
        hidden = self.head.embed(torch.tensor(list(token_ids), dtype=torch.long))  # [T, H]
        step = Step(session_id, hidden.to(self.blocks.device, self.blocks.dtype), 0, self.layers, position)
        out = self.blocks.forward([step])[0]  # [T, H]
        return int(self.head.logits(out[-1:], argmax_only=True)[0].argmax())


class ModelDrafter:
    """One session's greedy drafts from a DraftModel. ``cached`` are the tokens its cache holds."""

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self.session_id = f"draft-{secrets.token_hex(8)}"
        self.cached: list[int] = []
        self.open = False
        self.runs = 0  # forward calls through the draft layers (tests count them)
        self.fed = 0  # tokens those calls carried

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        try:
            return self._draft(list(history), k)
        except SwarmError as error:  # a full cache: no drafts this time, the session goes on without
            logger.debug("drafter %s: %s", self.session_id, error)
            self.close()
            return []

    def prepare(self, history: Sequence[int]) -> None:
        """Bring the cache up to ``history`` (the prompt once the swarm has run it, or the answer after steps
        without drafts), so that the next proposal runs only the tokens after it. Nothing to do where at most
        the last token is new: the proposal runs it with the next one."""
        tokens = list(history)
        if len(tokens) - _common_prefix(self.cached, tokens) > 1 and self._fits(len(tokens)):
            try:
                self._feed(tokens, len(tokens))
            except SwarmError as error:
                logger.debug("drafter %s: %s", self.session_id, error)
                self.close()

    def close(self) -> None:
        """Free the cache (a later proposal opens it again)."""
        if self.open:
            self.model.blocks.close_session(self.session_id)
        self.open, self.cached = False, []

    def _limit(self) -> int:
        """The most tokens a drafter session holds: the cache, or a sliding-window model's window (its blocks
        refuse longer sessions rather than attend differently)."""
        blocks = self.model.blocks
        window = blocks.max_context_tokens
        return min(blocks.cache.cache_tokens, window) if window else blocks.cache.cache_tokens

    def _fits(self, tokens: int) -> bool:
        return tokens <= self._limit()

    def _draft(self, tokens: list[int], k: int) -> list[int]:
        if not self._fits(len(tokens) + k):
            return []
        token = self._feed(tokens, len(tokens))
        drafts = [token]
        for _ in range(k - 1):
            token = self._feed([*tokens, *drafts], len(tokens) + len(drafts))
            drafts.append(token)
        return drafts

    def _feed(self, tokens: list[int], upto: int) -> int:
        """Cache tokens[:upto], reusing what the cache holds of them (at least the last is run): the greedy
        token after them."""
        if not self.open:
            self.model.blocks.open_session(self.session_id, self._limit())
            self.open, self.cached = True, []
        same = _common_prefix(self.cached, tokens[:upto])
        same = min(same, upto - 1)  # logits come from a token run now
        self.runs += 1
        self.fed += upto - same
        self.cached = self.cached[:same]  # what the cache keeps if the step fails (it cuts back first)
        try:
            token = self.model.run(self.session_id, tokens[same:upto], same)
        except SessionEvicted:  # other sessions took its blocks: it starts again from the first token
            self.cached, self.fed = [], self.fed + same
            token = self.model.run(self.session_id, tokens[:upto], 0)
        self.cached = tokens[:upto]
        return token


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def load_draft_model(
    config: ClientConfig, served: ModelSource, head: ClientHead, tokenizer: Any = None
) -> DraftModel | None:
    """The draft model ``config.speculate`` asks for (None unless "model" or "self"): ``served`` is the served
    model's checkpoint, ``head`` and ``tokenizer`` the client's."""
    if config.speculate == "self":
        layers = config.draft_layers
        if not 1 <= layers < served.spec.num_layers:
            raise ValueError(
                f"draft_layers must be in [1, {served.spec.num_layers}) for {served.spec.name}, got {layers}"
            )
        blocks = served.load_blocks(0, layers, config.device, config.dtype, config.draft_cache_tokens)
        return DraftModel(blocks, head)
    if config.speculate != "model":
        return None
    source = resolve_model(config.draft_model)
    check_same_vocab(source, served, tokenizer)
    draft_head = head if source.path == served.path else source.load_head(config.device, config.dtype)
    blocks = source.load_blocks(
        0, source.spec.num_layers, config.device, config.dtype, config.draft_cache_tokens
    )
    logger.info("drafting with %s (%d layers)", source.spec.name, source.spec.num_layers)
    return DraftModel(blocks, draft_head)


def check_same_vocab(draft: ModelSource, served: ModelSource, tokenizer: Any = None) -> None:
    """ValueError unless ``draft`` reads and writes the same token ids as ``served`` (whose tokenizer the
    client has loaded as ``tokenizer``, or None)."""
    if draft.spec.vocab_size != served.spec.vocab_size:
        raise ValueError(
            f"draft model {draft.spec.name} has a vocabulary of {draft.spec.vocab_size} tokens, the served "
            f"{served.spec.name} {served.spec.vocab_size}: a drafter must share the served model's tokenizer"
        )
    draft_tokenizer = draft.tokenizer()
    if (draft_tokenizer is None) != (tokenizer is None):
        raise ValueError(
            f"draft model {draft.spec.name} and the served {served.spec.name}: only one has a tokenizer"
        )
    if tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"draft model {draft.spec.name}'s tokenizer differs from the served {served.spec.name}'s: "
            "a drafter must share the served model's tokenizer"
        )
