"""The Llama block written out in plain torch ops (F.linear, scaled_dot_product_attention), on any device and
dtype: what GPUs run today, what the CPU backend runs where its kernels do not apply, and the reference every
faster form is tested against.

The weights and small submodules (norms, activation) are the transformers modules of the checkpoint's family;
projections go through ``project`` / ``projections``, which a subclass may compute in another form of the same
products. Steps of a batch see all their tokens as one [1, N, H] tensor for norms, projections and MLP (the
weights are read once); attention runs per step over its own session's cache, without padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.backends.base import Backend, Batch, HeadKernels, RangeKernels, Shape
from swarm.models.kv_cache import SessionCache

# each step's cache, its tokens and its (mask, is_causal), in the batch's order
Ragged = tuple[list[SessionCache], list[int], list[tuple[torch.Tensor | None, bool]]]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [1, heads, N, head_dim]; cos, sin: [N, head_dim] -> broadcast over heads
    return x * cos[None, None] + _rotate_half(x) * sin[None, None]


def attention_mask(first: int, tokens: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for ``tokens`` new queries after ``first`` cached keys."""
    if tokens == 1:
        return None, False  # one query sees every key
    if first == 0:
        return None, True  # no past: plain causal attention over the new tokens
    key_pos = torch.arange(first + tokens, device=device)  # [L]
    query_pos = first + torch.arange(tokens, device=device)  # [T]
    return key_pos[None, :] <= query_pos[:, None], False  # [T, L]: query i sees keys 0 .. first + i


class TorchRange(RangeKernels):
    """A range's layers in plain torch ops."""

    def run(self, batch: Batch, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        h = batch.hidden[None]  # [1, N, H]
        device = h.device
        masks = [attention_mask(p, t, device) for p, t in zip(batch.positions, batch.sizes, strict=True)]
        before = [[cache.length(layer) for layer in range(batch.start, batch.end)] for cache in batch.caches]
        try:
            for layer in range(batch.start, batch.end):
                if between_layers is not None and layer > batch.start:
                    between_layers()
                h = self.layer(layer, h, batch.cos, batch.sin, (batch.caches, batch.sizes, masks))
        except BaseException:
            _cut_back(batch, before)
            raise
        return h[0]

    def run_stateless(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        h = hidden[None]
        for layer in range(start, end):
            h = self.layer(layer, h, cos, sin, None)
        return h[0]

    def layer(
        self,
        layer: int,
        h: torch.Tensor,  # [1, N, H]
        cos: torch.Tensor,  # [N, head_dim]
        sin: torch.Tensor,
        ragged: Ragged | None,
    ) -> torch.Tensor:
        """One decoder layer; ``ragged``: each step's cache, tokens and (mask, is_causal), or None for one
        stateless step causal over its own tokens."""
        block: Any = self.layers[layer - self.first_layer]  # a transformers *DecoderLayer
        h = h + self.attention(layer, block.self_attn, block.input_layernorm(h), cos, sin, ragged)
        return h + self.mlp(block.mlp, block.post_attention_layernorm(h))

    def attention(
        self,
        layer: int,
        attn: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ragged: Ragged | None,
    ) -> torch.Tensor:
        """The attention of normed ``x`` [1, N, H], through o_proj: [1, N, H]."""
        tokens = x.shape[1]
        q, k, v = self.heads(attn, x)  # [1, nh, N, hd], [1, nkv, N, hd] twice
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ragged is None:
            out = self.attend(layer, q, k, v, None, tokens > 1)  # [1, nh, N, hd]
        else:
            outs, offset = [], 0
            for cache, size, (mask, causal) in zip(*ragged, strict=True):
                keys, values = cache.append(
                    layer, k[0, :, offset : offset + size], v[0, :, offset : offset + size]
                )  # [nkv, L, hd] each: the session's past and these tokens
                outs.append(
                    self.attend(
                        layer, q[:, :, offset : offset + size], keys[None], values[None], mask, causal
                    )
                )
                offset += size
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, nh, N, hd]
        out = out.transpose(1, 2).reshape(1, tokens, -1)  # [1, N, nh * hd]
        return self.project(out, attn.o_proj)

    def heads(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [1, nh, N, hd], keys and values [1, nkv, N, hd] of normed ``x`` [1, N, H], before RoPE."""
        tokens, head_dim = x.shape[1], self.shape.head_dim
        q, k, v = self.projections(x, (attn.q_proj, attn.k_proj, attn.v_proj))
        q = q.view(1, tokens, self.shape.num_heads, head_dim).transpose(1, 2)  # [1, nh, N, hd]
        k = k.view(1, tokens, self.shape.num_kv_heads, head_dim).transpose(1, 2)  # [1, nkv, N, hd]
        v = v.view(1, tokens, self.shape.num_kv_heads, head_dim).transpose(1, 2)
        return q, k, v

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [1, nh, T, hd]
        keys: torch.Tensor,  # [1, nkv, L, hd]: the step's past and its own T tokens
        values: torch.Tensor,
        mask: torch.Tensor | None,  # [T, L], True where a query sees a key
        causal: bool,
    ) -> torch.Tensor:
        """One step's attention: [1, nh, T, hd]."""
        gqa = self.shape.num_kv_heads != self.shape.num_heads
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=self.shape.scale, enable_gqa=gqa
        )

    def mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of transformers' *MLP, written out: normed x [1, N, H] -> [1, N, H]."""
        gate, up = self.projections(x, (mlp.gate_proj, mlp.up_proj))
        return self.project(mlp.act_fn(gate) * up, mlp.down_proj)

    def project(self, x: torch.Tensor, layer: Any) -> torch.Tensor:
        """``layer(x)`` for a projection of the layer (an nn.Linear, or the backend's held form of one)."""
        return F.linear(x, layer.weight, layer.bias)

    def projections(self, x: torch.Tensor, layers: Sequence[Any]) -> list[torch.Tensor]:
        """Projections of one input."""
        return [self.project(x, layer) for layer in layers]


def _cut_back(batch: Batch, before: list[list[int]]) -> None:
    """Forget what a failed call cached: each step's cache back to its length before the batch."""
    for cache, lengths in zip(batch.caches, before, strict=True):
        cache.cut(dict(zip(range(batch.start, batch.end), lengths, strict=True)))


class TorchHead(HeadKernels):
    """The LM head as one F.linear; a greedy step reads the argmax of those same logits."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return F.linear(normed, self.weight).float()

    def greedy_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.logits(normed)


class TorchBackend(Backend):
    """Plain torch on any device and dtype: weights as loaded, layers run by ``range_class`` (the Llama block's
    TorchRange, or a family's own, swarm.models.backends.families)."""

    name = "torch"

    def __init__(self, range_class: type[TorchRange] = TorchRange) -> None:
        self.range_class = range_class

    def range_kernels(
        self, layers: Sequence[nn.Module], first_layer: int, shape: Shape, pack_bytes: int
    ) -> RangeKernels:
        return self.range_class(layers, first_layer, shape)

    def head_kernels(self, weight: torch.Tensor, sample: Callable[[], torch.Tensor]) -> HeadKernels:
        return TorchHead(weight)
