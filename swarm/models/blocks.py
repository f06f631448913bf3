"""BlockRange: runs transformer layers [start, end) for a batch of sessions, each with its own KV cache.

The Llama block is written out here (rather than calling transformers' layer.forward) so we own the KV cache
layout and batching; the weights and small submodules (norms, projections, MLP, rotary embedding) are the
transformers modules of the checkpoint's family, so numerics match transformers.

One forward() call takes a list of Steps. Decode steps (one token) of different sessions that cover the same
sub-range run as ONE batched forward: norms, projections and MLP see a [B, 1, H] batch (the weights are read
once, which is what decode speed is bound by), attention runs per session over its own cache (no padding copies;
2x faster than padding+masking at 8 sessions of ~1k tokens on CPU). Prefill and stateless steps run one by one. A BlockRange is not thread-safe: one executor thread owns it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import ProtocolError, SessionError
from swarm.models.kv_cache import KVCache, SessionCache
from swarm.models.spec import ModelSpec
from swarm.types import LayerRange

logger = logging.getLogger(__name__)

_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def family_classes(model_type: str) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module]]:
    """(DecoderLayer, RotaryEmbedding, RMSNorm) classes of a transformers model_type."""
    prefix = _CLASS_PREFIX.get(model_type)
    if prefix is None:
        raise ValueError(f"unsupported model_type {model_type!r}: FlowSwarm runs {', '.join(_CLASS_PREFIX)}")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return (
        getattr(module, f"{prefix}DecoderLayer"),
        getattr(module, f"{prefix}RotaryEmbedding"),
        getattr(module, f"{prefix}RMSNorm"),
    )


@dataclass(frozen=True, eq=False)
class Step:
    """T tokens of one session through layers [start, end).

    position is how many tokens of the session were processed before these T: the cache is cut back to it
    first, so a retried or replayed step is idempotent. session_id None runs without any cache (position 0).
    """

    session_id: str | None
    hidden: torch.Tensor  # [T, hidden_size]
    start: int
    end: int
    position: int


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, head_dim]; cos, sin: [B, T, head_dim] -> broadcast over heads
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class BlockRange:
    """Layers [layers.start, layers.end) of one model, on one device, with a KV cache budget."""

    def __init__(
        self,
        spec: ModelSpec,
        config: object,
        layers: Sequence[nn.Module],
        layer_range: LayerRange,
        cache_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if len(layers) != len(layer_range):
            raise ValueError(f"got {len(layers)} layers for range {layer_range}")
        _, rotary_class, _ = family_classes(spec.model_type)
        self.spec = spec
        self.range = layer_range
        self.device = device
        self.dtype = dtype
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary_class(config=config).to(device)
        self.head_dim = int(getattr(config, "head_dim", None) or spec.hidden_size // spec.num_heads)
        self.cache = KVCache(layer_range, cache_tokens)
        # We attend over the whole context; a sliding-window model (Mistral v0.1) would see less past that window,
        # so sessions longer than the window are refused rather than silently computed differently.
        window = getattr(config, "sliding_window", None)
        self.max_context_tokens: int | None = int(window) if window else None

    # --- sessions -----------------------------------------------------------------------------------------

    def open_session(self, session_id: str, max_length_tokens: int) -> None:
        """Reserve max_length_tokens of cache (CapacityError when the budget would be exceeded)."""
        if self.max_context_tokens is not None and max_length_tokens > self.max_context_tokens:
            raise ProtocolError(
                f"max_length_tokens {max_length_tokens} exceeds the sliding window of {self.spec.name} "
                f"({self.max_context_tokens} tokens), which FlowSwarm does not implement"
            )
        self.cache.open(session_id, max_length_tokens)

    def close_session(self, session_id: str) -> None:
        self.cache.close(session_id)

    @property
    def free_cache_tokens(self) -> int:
        return self.cache.free_tokens

    @property
    def active_sessions(self) -> list[str]:
        return self.cache.session_ids

    def session_length(self, session_id: str, layer: int) -> int:
        if layer not in self.range:
            raise ProtocolError(f"layer {layer} is not in this block's range {self.range}")
        return self.cache.get(session_id).length(layer)

    # --- forward ------------------------------------------------------------------------------------------

    def validate(self, step: Step) -> None:
        """Raise ProtocolError / SessionError if `step` cannot run here. Changes nothing."""
        hidden = step.hidden
        if not isinstance(hidden, torch.Tensor) or hidden.ndim != 2 or hidden.shape[0] == 0:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ProtocolError(
                f"hidden must be a tensor [T, {self.spec.hidden_size}] with T >= 1, got {shape}"
            )
        if hidden.shape[1] != self.spec.hidden_size:
            raise ProtocolError(f"hidden size {hidden.shape[1]} != model hidden size {self.spec.hidden_size}")
        if hidden.dtype != self.dtype:
            raise ProtocolError(f"hidden dtype {hidden.dtype} != block dtype {self.dtype}")
        if not (self.range.start <= step.start < step.end <= self.range.end):
            raise ProtocolError(
                f"layers [{step.start}, {step.end}) are not inside this block's range {self.range}"
            )
        if step.position < 0:
            raise ProtocolError(f"position must be >= 0, got {step.position}")
        if step.session_id is None:
            if self.max_context_tokens is not None and hidden.shape[0] > self.max_context_tokens:
                raise ProtocolError(f"{hidden.shape[0]} tokens exceed the sliding window of {self.spec.name}")
            if step.position != 0:
                raise ProtocolError(
                    f"a stateless step (no session) must start at position 0, got {step.position}"
                )
            return
        session = self.cache.get(step.session_id)
        for layer in range(step.start, step.end):
            if session.length(layer) < step.position:
                raise SessionError(
                    f"session {step.session_id}: step at position {step.position} but layer {layer} "
                    f"holds only {session.length(layer)} tokens"
                )
        if step.position + hidden.shape[0] > session.max_length_tokens:
            raise ProtocolError(
                f"session {step.session_id}: {step.position} + {hidden.shape[0]} tokens exceed its max length "
                f"{session.max_length_tokens}"
            )

    @torch.no_grad()  # not inference_mode: callers may modify outputs in place
    def forward(self, steps: Sequence[Step]) -> list[torch.Tensor]:
        """Run every step; returns one hidden tensor [T, hidden_size] per step, in order, on self.device."""
        seen: set[str] = set()
        for step in steps:
            self.validate(step)
            if step.session_id is not None:
                if step.session_id in seen:
                    raise ProtocolError(f"session {step.session_id} appears twice in one forward")
                seen.add(step.session_id)
        for step in steps:  # only now change state: cut caches back to each step's position
            if step.session_id is not None:
                session = self.cache.get(step.session_id)
                for layer in range(step.start, step.end):
                    session.truncate(layer, step.position)

        outputs: list[torch.Tensor | None] = [None] * len(steps)
        decode_groups: dict[tuple[int, int], list[int]] = {}
        for i, step in enumerate(steps):
            if step.session_id is not None and step.hidden.shape[0] == 1:
                decode_groups.setdefault((step.start, step.end), []).append(i)
            else:
                outputs[i] = self._run([step])[0]
        for group in decode_groups.values():
            for i, out in zip(group, self._run([steps[i] for i in group]), strict=True):
                outputs[i] = out
        return [out for out in outputs if out is not None]

    def _run(self, steps: list[Step]) -> list[torch.Tensor]:
        """Steps with the same [start, end) and T (several only when T == 1) as one batch."""
        start, end = steps[0].start, steps[0].end
        h = torch.stack([s.hidden.to(self.device) for s in steps])  # [B, T, H]
        batch, tokens = h.shape[0], h.shape[1]
        positions = torch.tensor([s.position for s in steps], device=self.device)
        position_ids = positions[:, None] + torch.arange(tokens, device=self.device)  # [B, T]
        cos, sin = self.rotary(h, position_ids)  # [B, T, head_dim] each, in h's dtype

        caches = None if steps[0].session_id is None else [self.cache.get(s.session_id or "") for s in steps]
        mask: torch.Tensor | None = None
        is_causal = False
        first = steps[0].position
        if caches is None or (batch == 1 and first == 0):
            is_causal = tokens > 1  # no past: plain causal attention over the T new tokens
        elif batch == 1 and tokens > 1:
            # T new queries after `first` cached keys: query i sees keys 0 .. first + i.
            key_pos = torch.arange(first + tokens, device=self.device)  # [L]
            mask = key_pos[None, :] <= (first + torch.arange(tokens, device=self.device))[:, None]  # [T, L]

        for layer in range(start, end):
            h = self._layer(layer, h, cos, sin, caches, mask, is_causal)
        return list(h.unbind(0))

    def _layer(
        self,
        layer: int,
        h: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[SessionCache] | None,
        mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        block: Any = self.layers[layer - self.range.start]  # a transformers *DecoderLayer
        attn = block.self_attn
        batch, tokens, _ = h.shape
        num_heads, num_kv, head_dim = self.spec.num_heads, self.spec.num_kv_heads, self.head_dim

        x = block.input_layernorm(h)  # [B, T, H]
        q = attn.q_proj(x).view(batch, tokens, num_heads, head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = attn.k_proj(x).view(batch, tokens, num_kv, head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = attn.v_proj(x).view(batch, tokens, num_kv, head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        gqa = num_kv != num_heads

        if caches is not None and batch > 1:
            # Batched decode (T == 1): attention per session over its own cache, no padding.
            outs = []
            for b, cache in enumerate(caches):
                keys, values = cache.append(layer, k[b], v[b])  # [nkv, L_b, hd]
                outs.append(
                    F.scaled_dot_product_attention(
                        q[b : b + 1], keys[None], values[None], scale=attn.scaling, enable_gqa=gqa
                    )
                )
            out = torch.cat(outs)  # [B, nh, 1, hd]
        else:
            if caches is not None:
                keys, values = caches[0].append(layer, k[0], v[0])  # [nkv, L, hd], past + new
                k, v = keys[None], values[None]  # [1, nkv, L, hd]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=attn.scaling, enable_gqa=gqa
            )  # [B, nh, T, hd]
        out = out.transpose(1, 2).reshape(batch, tokens, num_heads * head_dim)  # [B, T, nh * hd]
        h = h + attn.o_proj(out)
        return h + block.mlp(block.post_attention_layernorm(h))
