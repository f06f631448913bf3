"""The client's ends of the model: token embeddings in, final norm + LM head out, and sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.argmax import ROWS_TIMED, ArgmaxScreen, calibrated_screen
from swarm.models.matmul import Forms, calibrate, linear, taken
from swarm.models.spec import ModelSpec


class ClientHead:
    """Embeddings and LM head of a model; the client keeps these, peers hold the blocks in between."""

    def __init__(
        self,
        spec: ModelSpec,
        embed_weight: torch.Tensor,  # [V, H]
        norm: nn.Module,
        lm_head_weight: torch.Tensor,  # [V, H]; the same tensor as embed_weight when embeddings are tied
    ) -> None:
        self.spec = spec
        self.embed_weight = embed_weight
        self.norm = norm
        self.lm_head_weight = lm_head_weight
        self.device = embed_weight.device
        self.dtype = embed_weight.dtype
        # the form of the LM head worth taking on this CPU, as measured (swarm.models.matmul); a packed copy
        # where it pays, as large as the LM head (113 MB for the default model; CPU float32 heads only)
        self.use_forms(calibrate([lm_head_weight], packing=True))
        # greedy steps: the argmax through an int8 screen, for inputs of up to this many rows (swarm.models.argmax)
        self.screen: ArgmaxScreen | None = None
        self.screened_rows = 0
        if self.device.type == "cpu" and self.dtype == torch.float32:
            self._calibrate_screen()

    def _calibrate_screen(self) -> None:
        # embedding rows spread over the vocabulary stand in for last hidden states: their logits have a clear top
        ids = torch.linspace(0, self.spec.vocab_size - 1, max(ROWS_TIMED)).long()
        with torch.no_grad():
            sample = self.norm(self.embed_weight[ids])
            self.use_screen(*calibrated_screen(self._dense, self.lm_head_weight, sample))

    def use_screen(self, screen: ArgmaxScreen | None, rows: int) -> None:
        """Screen greedy inputs of 1 to ``rows`` rows through ``screen`` (None or 0: never)."""
        self.screen, self.screened_rows = (screen, rows) if screen is not None and rows > 0 else (None, 0)

    def use_forms(self, forms: Forms) -> None:
        """Take ``forms`` for the LM head from now on, keeping a packed copy of it only if they use one."""
        self.forms, copies = taken(forms, [self.lm_head_weight])
        self._packed = copies.get(id(self.lm_head_weight))

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
        return F.embedding(token_ids.to(self.device), self.embed_weight)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """hidden [..., H] (output of the last layer) -> logits [..., V] in float32.

        ``argmax_only`` (a greedy pick reads nothing else): each row's argmax is that of its exact logits, and
        entries that cannot be it may be -inf instead of their logit (see swarm.models.argmax)."""
        if hidden.shape[-1] != self.spec.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} != model hidden size {self.spec.hidden_size}")
        normed = self.norm(hidden.to(self.device, self.dtype))
        rows = normed.reshape(-1, self.hidden_size)  # [N, H]
        if argmax_only and self.screen is not None and 0 < rows.shape[0] <= self.screened_rows:
            return self.screen.logits(rows, self._dense).reshape(*normed.shape[:-1], -1)
        return self._dense(normed)

    def _dense(self, normed: torch.Tensor) -> torch.Tensor:
        return linear(normed, self.lm_head_weight, None, self.forms, self._packed).float()


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
        p = self.params
        if p.greedy:  # nothing to rewrite, so no copy
            return int(logits.detach().argmax())
        scores = logits.detach().float().cpu().clone()  # [V]
        if p.repetition_penalty != 1.0 and len(previous_token_ids):
            seen = torch.as_tensor(previous_token_ids, dtype=torch.long).unique()
            picked = scores[seen]
            scores[seen] = torch.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        if p.temperature == 0.0:
            return int(scores.argmax())
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
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
