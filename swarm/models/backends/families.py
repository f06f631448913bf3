"""Decoder layers of the families whose block is not the Llama block, in plain torch ops on any device.

Each is a TorchRange whose hooks (heads, attend, mlp, layer) compute what its transformers modules compute;
the backend chooses the class once, from the model_type (``family_range``), so the Llama path runs unchanged.

- Qwen3: an RMSNorm over each head of the queries and keys, before RoPE.
- Mixtral: a sparse mixture of experts in place of the MLP; each token is routed on its own to its top-k
  experts by the router's softmax, renormalised over the chosen ones (as transformers does).
- Gemma 2: norms after attention and around the MLP, attention logits soft-capped, the sliding window on
  the layers that have one (the cache keeps every token; the window is a mask), a GELU-tanh MLP.
- Gemma 3 (text-only checkpoints): Gemma 2's layer with Qwen3's per-head q and k norms, no soft-caps, and a
  RoPE base of their own on the sliding layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.backends.base import Batch, Shape
from swarm.models.backends.generic import Ragged, TorchRange


def _normed_heads(
    kernels: TorchRange, attn: Any, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TorchRange.heads with q and k normed per head (attn.q_norm, attn.k_norm over head_dim) before RoPE."""
    tokens, shape = x.shape[1], kernels.shape
    q, k, v = kernels.projections(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    q = attn.q_norm(q.view(1, tokens, shape.num_heads, shape.head_dim))  # [1, N, nh, hd]
    k = attn.k_norm(k.view(1, tokens, shape.num_kv_heads, shape.head_dim))  # [1, N, nkv, hd]
    v = v.view(1, tokens, shape.num_kv_heads, shape.head_dim)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, nh or nkv, N, hd]


class Qwen3Range(TorchRange):
    """Qwen3: q and k normed per head before RoPE."""

    def heads(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _normed_heads(self, attn, x)


class MixtralRange(TorchRange):
    """Mixtral: the MLP is a sparse mixture of experts (transformers' MixtralSparseMoeBlock, weights fused per
    expert: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""

    def mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, H]: every token of the batch routed on its own
        logits = F.linear(rows, mlp.gate.weight)  # [N, E]
        weights, chosen = torch.topk(logits.float().softmax(-1), mlp.gate.top_k, dim=-1)  # [N, k] each
        weights = weights / weights.sum(-1, keepdim=True)
        experts = mlp.experts
        out = torch.zeros_like(rows)
        for expert in chosen.unique().tolist():  # the experts some token chose, in order
            token, slot = torch.where(chosen == expert)  # [M] each: which tokens, at which of their k
            gate, up = F.linear(rows[token], experts.gate_up_proj[expert]).chunk(2, dim=-1)  # [M, I] each
            y = F.linear(experts.act_fn(gate) * up, experts.down_proj[expert])  # [M, H]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out.view_as(x)


class Gemma2Range(TorchRange):
    """Gemma 2: post-attention and pre/post-feedforward norms, soft-capped attention logits, and the sliding
    window on the layers whose attention has one (layers keep every token cached; older ones are masked)."""

    windowed = True

    def __init__(self, layers: Sequence[nn.Module], first_layer: int, shape: Shape) -> None:
        super().__init__(layers, first_layer, shape)
        attns: list[Any] = [layer.self_attn for layer in self.layers]
        if not all(getattr(a, "is_causal", True) for a in attns):
            raise ValueError(
                "a Gemma checkpoint with bidirectional attention: FlowSwarm runs causal models only"
            )
        self.windows: list[int | None] = [getattr(a, "sliding_window", None) for a in attns]
        self.softcaps: list[float | None] = [getattr(a, "attn_logit_softcapping", None) for a in attns]

    def layer(
        self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ragged: Ragged | None
    ) -> torch.Tensor:
        block: Any = self.layers[layer - self.first_layer]
        attended = self.attention(layer, block.self_attn, block.input_layernorm(h), cos, sin, ragged)
        h = h + block.post_attention_layernorm(attended)
        return h + block.post_feedforward_layernorm(self.mlp(block.mlp, block.pre_feedforward_layernorm(h)))

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [1, nh, T, hd]
        keys: torch.Tensor,  # [1, nkv, L, hd]: the step's past (L - T tokens) and its own T tokens
        values: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """Eager attention as transformers' Gemma 2 computes it: scores scaled, soft-capped, masked (causal, and
        inside the window on a sliding layer), softmax in float32. The mask is made here from T and L."""
        tokens, length = q.shape[2], keys.shape[2]
        groups = self.shape.num_heads // self.shape.num_kv_heads
        keys = keys.repeat_interleave(groups, 1)  # [1, nh, L, hd]: each kv head for its group of queries
        values = values.repeat_interleave(groups, 1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.shape.scale  # [1, nh, T, L]
        softcap = self.softcaps[layer - self.first_layer]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = length - tokens + torch.arange(tokens, device=q.device)[:, None]  # [T, 1]
        key_pos = torch.arange(length, device=q.device)[None, :]  # [1, L]
        visible = key_pos <= query_pos  # [T, L]
        window = self.windows[layer - self.first_layer]
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)  # [1, nh, T, hd]


class Gemma3Range(Gemma2Range):
    """Gemma 3 (text): Gemma 2's layer without soft-caps, with q and k normed per head before RoPE, and the
    sliding layers' RoPE at a base of their own: the batch brings the full-attention layers' angles, the local
    ones are made here from the same positions."""

    def __init__(self, layers: Sequence[nn.Module], first_layer: int, shape: Shape) -> None:
        super().__init__(layers, first_layer, shape)
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        attns: list[Any] = [layer.self_attn for layer in self.layers]
        self.sliding = [a.layer_type == "sliding_attention" for a in attns]
        device = next(iter(self.layers[0].parameters())).device if self.layers else None
        self.local_rotary = Gemma3RotaryEmbedding(attns[0].config).to(device) if self.layers else None
        # each running call's local (cos, sin) [N, hd], by the id of its full-attention cos: calls of one range
        # overlap (a decode call runs between a prefill chunk's layers, on another thread or inside it)
        self._local: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(self, batch: Batch, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        positions = [torch.arange(p, p + t) for p, t in zip(batch.positions, batch.sizes, strict=True)]
        self._local[id(batch.cos)] = self._local_angles(batch.hidden, torch.cat(positions))
        try:
            return super().run(batch, between_layers)
        finally:
            del self._local[id(batch.cos)]

    def run_stateless(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        self._local[id(cos)] = self._local_angles(hidden, torch.arange(hidden.shape[0]))
        try:
            return super().run_stateless(hidden, cos, sin, start, end)
        finally:
            del self._local[id(cos)]

    def _local_angles(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding layers' (cos, sin) [N, head_dim] at ``positions`` [N], in ``hidden``'s dtype."""
        assert self.local_rotary is not None, "a range of no layers runs nothing"
        cos, sin = self.local_rotary(hidden[None], positions.to(hidden.device)[None], "sliding_attention")
        return cos[0], sin[0]

    def layer(
        self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ragged: Ragged | None
    ) -> torch.Tensor:
        if self.sliding[layer - self.first_layer]:
            cos, sin = self._local[id(cos)]
        return super().layer(layer, h, cos, sin, ragged)

    def heads(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _normed_heads(self, attn, x)


# model_type -> its range class; model types not here run the Llama block (TorchRange and the devices' forms)
FAMILY_RANGES: dict[str, type[TorchRange]] = {
    "qwen3": Qwen3Range,
    "mixtral": MixtralRange,
    "gemma2": Gemma2Range,
    "gemma3_text": Gemma3Range,
}


def family_range(model_type: str) -> type[TorchRange] | None:
    """The range class of ``model_type``'s own layer, or None where it is the Llama block."""
    return FAMILY_RANGES.get(model_type)


__all__ = ["FAMILY_RANGES", "Gemma2Range", "Gemma3Range", "MixtralRange", "Qwen3Range", "family_range"]
