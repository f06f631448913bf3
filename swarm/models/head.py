"""The client's ends of the model: token embeddings in, final norm + LM head out, and sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.backends import for_device
from swarm.models.spec import ModelSpec

SAMPLE_ROWS = 8  # rows like a model's last hidden states that a backend may time its head's forms on


class ClientHead:
    """Embeddings and LM head of a model; the client keeps these, peers hold the blocks in between."""

    def __init__(
        self,
        spec: ModelSpec,
        embed_weight: torch.Tensor,  # [V, H]
        norm: nn.Module,
        lm_head_weight: torch.Tensor,  # [V, H]; the same tensor as embed_weight when embeddings are tied
        embed_scale: float | None = None,  # embeddings multiplied by it (Gemma 2: sqrt of the hidden size)
        logit_softcap: float | None = None,  # logits made cap * tanh(logits / cap) (Gemma 2)
    ) -> None:
        self.spec = spec
        # in the weights' dtype, rounded through float32 as transformers' scaled embedding does
        self.embed_scale = None if embed_scale is None else torch.tensor(embed_scale).to(embed_weight.dtype)
        self.logit_softcap = logit_softcap
        self.embed_weight = embed_weight
        self.norm = norm
        self.lm_head_weight = lm_head_weight
        self.device = embed_weight.device
        self.dtype = embed_weight.dtype
        self.backend = for_device(self.device, self.dtype)
        self.kernels = self.backend.head_kernels(lm_head_weight, self._sample)

    def _sample(self) -> torch.Tensor:
        """Normed embedding rows spread over the vocabulary: they stand in for last hidden states, whose logits
        have a clear top (random rows have flat logits)."""
        ids = torch.linspace(0, self.spec.vocab_size - 1, SAMPLE_ROWS).long()
        with torch.no_grad():
            return self.norm(self.embed_weight[ids])

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] (int64) -> hidden [T, H] in the head's dtype."""
        if token_ids.dtype not in (torch.int64, torch.int32) or token_ids.ndim != 1:
            raise ValueError(
                f"token_ids must be a 1-D integer tensor, got {token_ids.dtype} {tuple(token_ids.shape)}"
            )
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        hidden = F.embedding(token_ids.to(self.device), self.embed_weight)
        return hidden if self.embed_scale is None else hidden * self.embed_scale.to(self.device)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """hidden [..., H] (output of the last layer) -> logits [..., V] in float32.

        ``argmax_only`` (a greedy pick reads nothing else): each row's argmax is exact as the backend defines it
        (HeadKernels.greedy_logits), and entries that cannot be it may be -inf instead of their logit. Soft-capped
        logits are always whole: capping can make distinct logits equal, and the first of them is the argmax."""
        if hidden.shape[-1] != self.spec.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} != model hidden size {self.spec.hidden_size}")
        normed = self.norm(hidden.to(self.device, self.dtype))
        rows = normed.reshape(-1, self.hidden_size)  # [N, H]
        if self.logit_softcap is not None:
            cap = self.logit_softcap
            out = torch.tanh(self.kernels.logits(rows) / cap) * cap
        elif argmax_only:
            out = self.kernels.greedy_logits(rows)
        else:
            out = self.kernels.logits(rows)
        return out.reshape(*normed.shape[:-1], -1)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0  # softmax temperature; 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; 1 = all
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence (CTRL-style)
    seed: int = 0  # seed of the sampler's own generator

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """Whether a pick reads only the argmax of the logits (as it is: no penalty rewrites them first)."""
        return self.temperature == 0.0 and self.repetition_penalty == 1.0


class Sampler:
    """Picks tokens from logits with its own seeded generator: the same seed gives the same tokens."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed)

    def sample(self, logits: torch.Tensor, previous_token_ids: Sequence[int] | torch.Tensor = ()) -> int:
        """logits [V] -> the next token id."""
        if logits.ndim != 1:
            raise ValueError(f"logits must be 1-D [V], got shape {tuple(logits.shape)}")
        if self.params.greedy:  # nothing to rewrite, so no copy
            return int(logits.detach().argmax())
        scores = self._scores(logits, previous_token_ids)
        if self.params.temperature == 0.0:
            return int(scores.argmax())
        return self.draw(scores.softmax(-1))

    def distribution(
        self, logits: torch.Tensor, previous_token_ids: Sequence[int] | torch.Tensor = ()
    ) -> torch.Tensor:
        """The probabilities [V] that `sample` draws from (all on one token where it picks the top one):
        what speculative sampling checks drafts against."""
        if logits.ndim != 1:
            raise ValueError(f"logits must be 1-D [V], got shape {tuple(logits.shape)}")
        if self.params.greedy or self.params.temperature == 0.0:
            scores = (
                logits.detach().float().cpu()
                if self.params.greedy
                else self._scores(logits, previous_token_ids)
            )
            return torch.nn.functional.one_hot(scores.argmax(), scores.numel()).float()
        return self._scores(logits, previous_token_ids).softmax(-1)

    def draw(self, probs: torch.Tensor) -> int:
        """A token drawn from ``probs`` [V] (not necessarily normalised) with this sampler's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A number in [0, 1) from this sampler's generator."""
        return float(torch.rand((), generator=self.generator))

    def _scores(self, logits: torch.Tensor, previous_token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """logits after the repetition penalty and, unless the temperature is 0, temperature, top-k and top-p
        (dropped tokens at -inf)."""
        p = self.params
        scores = logits.detach().float().cpu().clone()  # [V]
        if p.repetition_penalty != 1.0 and len(previous_token_ids):
            seen = torch.as_tensor(previous_token_ids, dtype=torch.long).unique()
            picked = scores[seen]
            scores[seen] = torch.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        if p.temperature == 0.0:
            return scores
        scores = scores / p.temperature
        if 0 < p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores[scores < kth] = float("-inf")
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # drop a token when the tokens before it already reach top_p (the top token always stays)
            drop = (cumulative - sorted_scores.softmax(-1)) >= p.top_p
            scores[order[drop]] = float("-inf")
        return scores
