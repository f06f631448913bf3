"""BlockRange: runs transformer layers [start, end) for a batch of sessions, each with its own KV cache.

The Llama block is written out here (rather than calling transformers' layer.forward) so we own the KV cache
layout and batching. The weights and small submodules (norms, activation, rotary embedding) are the transformers
modules of the checkpoint's family; the projections run through swarm.models.matmul (``F.linear``, or where this
CPU does the few rows of a decode step faster another way, the same dot products in another order), so numerics
match transformers to float rounding.

One forward() call takes a list of Steps. Steps of different sessions that cover the same sub-range run as ONE
batched forward, whatever their lengths (decode steps of one token and prefill chunks mixed, as Sarathi does):
norms, projections and MLP see all their tokens as one [1, N, H] tensor (the weights are read once, which is
what decode speed is bound by, and decode rows ride along a prefill chunk almost for free), attention runs per
step over its own session's cache (no padding copies; 2x faster than padding+masking at 8 sessions of ~1k tokens
on CPU). Stateless steps (no session) run one by one. A BlockRange is not thread-safe: one executor thread owns it.

Steps of few tokens in all (decode steps, short prefills such as spot-check windows) whose layers are all
packed 4-bit go through swarm.models.int4's decode_layers instead, one C call per forward call (a layer a call
for a prefill that gives way between layers): the same operations without an interpreter and dispatch cost for
each of them, which on a CPU cost more than a one-row step's products.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.models import int4
from swarm.models.kv_cache import KVCache, SessionCache
from swarm.models.matmul import Forms, calibrate, linear_together, packed_together, project, taken
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
        pack_bytes: int = 0,
    ) -> None:
        """``pack_bytes``: memory this range may spend on packed copies of its weights (swarm.models.matmul), which
        speed up batched decode steps on a CPU; 0 keeps none."""
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
        # the MLP's activation, which int4.decode_layers computes only for SiLU
        self._silu = getattr(config, "hidden_act", None) in ("silu", "swish")
        # the forms of the projections worth taking on this CPU, as measured (swarm.models.matmul)
        weights = self._weights()
        affordable = 0 < sum(w.numel() * w.element_size() for w in weights) <= pack_bytes
        self.use_forms(calibrate(weights, packing=affordable))

    def _weights(self) -> list[torch.Tensor]:
        return [m.weight for m in self.layers.modules() if isinstance(m, nn.Linear)]

    def use_forms(self, forms: Forms) -> None:
        """Take ``forms`` for the projections from now on, keeping packed copies of the weights only if they use
        them (on the torch thread, or before serving)."""
        self.forms, self._packed = taken(forms, self._weights())
        # the projections that read the same input, packed together where the form allows (one product each)
        self._together = {
            id(group[0]): together
            for block in self.layers
            for group in _same_input(block)
            if (together := packed_together(self.forms, self._packed, group)) is not None
        }
        # each layer as int4.decode_layers takes it, where it can (None: the layer's decode steps go through _layer)
        self._fused = [self._fused_weights(block) for block in self.layers]
        self._layer_runs: dict[tuple[int, int], int4.LayerRun] = {}  # by [start, end): _layer_run
        attn: Any = getattr(self.layers[0], "self_attn", None) if len(self.layers) else None
        scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self._attention = int4.Attention(self.spec.num_heads, self.spec.num_kv_heads, self.head_dim, scale)

    def _fused_weights(self, block: Any) -> int4.LayerWeights | None:
        """The layer's weights for int4.decode_layers: a Llama-family layer (RMSNorms, SiLU-gated MLP, no biases,
        no norms of q and k) whose projections are all packed 4-bit, q, k, v and gate, up together."""
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        norms: list[Any] = [getattr(block, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if attn is None or mlp is None or not self._silu or not int4.takes_head_dim(self.head_dim):
            return None
        if any(getattr(attn, name, None) is not None for name in ("q_norm", "k_norm")):
            return None
        if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms):
            return None
        weights = [n.weight for n in norms]
        if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in weights):
            return None
        if norms[0].variance_epsilon != norms[1].variance_epsilon:
            return None
        qkv = self._together.get(id(attn.q_proj.weight))
        gate_up = self._together.get(id(mlp.gate_proj.weight))
        o, down = self._packed.get(id(attn.o_proj.weight)), self._packed.get(id(mlp.down_proj.weight))
        if qkv is None or gate_up is None or o is None or down is None:
            return None
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            return None
        return int4.LayerWeights(
            weights[0],
            weights[1],
            float(norms[0].variance_epsilon),
            qkv,
            o,
            gate_up,
            down,
            int(mlp.down_proj.weight.shape[1]),
        )

    def same_form(self, rows: int, more_rows: int) -> bool:
        """Whether ``more_rows`` more rows leave a forward call of ``rows`` in the same form of products (always
        off the CPU, where every call is F.linear)."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return True
        return self.forms.form(rows) == self.forms.form(rows + more_rows)

    # --- sessions -----------------------------------------------------------------------------------------

    def open_session(self, session_id: str, max_length_tokens: int) -> None:
        """Reserve max_length_tokens of cache (CapacityError when the budget would be exceeded)."""
        if self.max_context_tokens is not None and max_length_tokens > self.max_context_tokens:
            raise ProtocolError(
                f"max_length_tokens {max_length_tokens} exceeds the sliding window of {self.spec.name} "
                f"({self.max_context_tokens} tokens), which FlowSwarm does not implement"
            )
        self.cache.open(session_id, max_length_tokens)

    def carry_sessions(self, old: BlockRange) -> list[str]:
        """Take over every session open on ``old``, a range this one contains (on the torch thread): the same
        session ids and cache tensors, so their next steps, which may still name ``old``'s layers only, run
        here as they would have there. ``old`` keeps pointing at the same caches, so a step already queued on
        it still runs correctly; drop ``old`` afterwards. Returns the ids carried over."""
        if not self.range.covers(old.range):
            raise ValueError(
                f"cannot carry sessions from {old.range} into {self.range}: it does not contain it"
            )
        if (old.device, old.dtype) != (self.device, self.dtype):
            raise ValueError(
                f"cannot carry sessions from {old.device}/{old.dtype} to {self.device}/{self.dtype}"
            )
        carried = old.cache.session_ids
        needed = sum(old.cache.get(s).max_length_tokens for s in carried)
        if needed > self.cache.free_tokens:  # checked first: never carry half of them
            raise CapacityError(
                f"carrying {len(carried)} sessions needs {needed} cache tokens, {self.cache.free_tokens} free"
            )
        for session_id in carried:
            self.cache.adopt(old.cache.get(session_id))
        return carried

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
    def forward(
        self, steps: Sequence[Step], between_layers: Callable[[], None] | None = None
    ) -> list[torch.Tensor]:
        """Run every step; returns one hidden tensor [T, hidden_size] per step, in order, on self.device.
        ``between_layers`` is called before each layer after the first (the executor's prefill lane waits there
        for a decode step running beside it)."""
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
        groups: dict[tuple[int, int], list[int]] = {}
        for i, step in enumerate(steps):
            if step.session_id is not None:
                groups.setdefault((step.start, step.end), []).append(i)
            else:
                outputs[i] = self._run_stateless(step)
        for group in groups.values():
            for i, out in zip(group, self._run([steps[i] for i in group], between_layers), strict=True):
                outputs[i] = out
        return [out for out in outputs if out is not None]

    def _run(self, steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Session steps with the same [start, end), any number of tokens each (decode steps and prefill chunks
        alike), as one batch: their N tokens in all go through norms, projections and MLP as one [1, N, H]
        tensor; attention runs per step over its own session's cache."""
        start, end = steps[0].start, steps[0].end
        sizes = [s.hidden.shape[0] for s in steps]
        h = torch.cat([s.hidden.to(self.device) for s in steps])[None]  # [1, N, H]
        position_ids = torch.cat(
            [
                torch.arange(s.position, s.position + t, device=self.device)
                for s, t in zip(steps, sizes, strict=True)
            ]
        )[None]  # [1, N]
        cos, sin = self.rotary(h, position_ids)  # [1, N, head_dim] each, in h's dtype
        caches = [self.cache.get(s.session_id or "") for s in steps]
        if self._fusable(start, end, sizes, h):
            return self._run_fused(h[0], cos[0], sin[0], caches, sizes, start, end, between_layers)
        attention = [self._attention_mask(s.position, t) for s, t in zip(steps, sizes, strict=True)]
        for layer in range(start, end):
            if between_layers is not None and layer > start:
                between_layers()
            h = self._layer(layer, h, cos, sin, _Ragged(caches, sizes, attention))
        return list(h[0].split(sizes))

    def _fusable(self, start: int, end: int, sizes: list[int], h: torch.Tensor) -> bool:
        """Whether these steps go through int4.decode_layers: as many tokens in all as the 4-bit form takes
        (decode steps, short prefills such as spot-check windows, and both in one call), float32 on the CPU, and
        every layer fused."""
        return (
            self.forms.packs(sum(sizes))
            and h.dtype == torch.float32
            and h.device.type == "cpu"
            and all(w is not None for w in self._fused[start - self.range.start : end - self.range.start])
        )

    def _run_fused(
        self,
        h: torch.Tensor,  # [N, H], the steps' tokens one after another
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[SessionCache],
        sizes: list[int],
        start: int,
        end: int,
        between_layers: Callable[[], None] | None,
    ) -> list[torch.Tensor]:
        """_run for steps of few tokens through int4.decode_layers (h is changed in place): the whole range in one
        call, or a layer a call where ``between_layers`` gives way between them. A failed call leaves the caches
        as they were before the step. A step's tokens are rows at consecutive positions of one cache: each row
        attends to the rows before it, which the call has cached by then, so a step of several tokens is causal as
        in _layer."""
        h = h.contiguous()
        # what each step's cache grows by
        likes = {size: torch.empty(self.spec.num_kv_heads, size, self.head_dim) for size in set(sizes)}

        def slots(layer: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
            reserved: list[tuple[torch.Tensor, torch.Tensor, int]] = []
            for cache, size in zip(caches, sizes, strict=True):
                keys, values, length = cache.reserve(layer, likes[size])
                reserved.extend((keys, values, length + i) for i in range(size))
            return reserved

        before = [[cache.length(layer) for layer in range(start, end)] for cache in caches]
        try:
            if between_layers is None:  # the whole range in one call
                run = self._layer_run(start, end)
                all_slots = [slots(layer) for layer in range(start, end)]
                int4.decode_layers(h, run, self._attention, cos, sin, all_slots)
            else:
                for layer in range(start, end):
                    if layer > start:
                        between_layers()
                    run = self._layer_run(layer, layer + 1)
                    int4.decode_layers(h, run, self._attention, cos, sin, [slots(layer)])
        except BaseException:
            # reserved tokens that were not written (all layers are reserved before the call) must not count as
            # cached: a later step would pass _in_order and attend to garbage instead of being told to replay
            for cache, lengths in zip(caches, before, strict=True):
                for layer, length in zip(range(start, end), lengths, strict=True):
                    cache.truncate(layer, length)
            raise
        return list(h.split(sizes))

    def _layer_run(self, start: int, end: int) -> int4.LayerRun:
        """The fused layers [start, end) as one int4.LayerRun, gathered on first use (and again if they
        changed)."""
        layers = [w for w in self._fused[start - self.range.start : end - self.range.start] if w is not None]
        assert len(layers) == end - start, "every layer of a fused run is fused (_fusable)"
        run = self._layer_runs.get((start, end))
        if run is None or not run.of(layers):
            run = self._layer_runs[(start, end)] = int4.LayerRun(layers)
        return run

    def _attention_mask(self, first: int, tokens: int) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for ``tokens`` new queries after ``first`` cached keys."""
        if tokens == 1:
            return None, False  # one query sees every key
        if first == 0:
            return None, True  # no past: plain causal attention over the new tokens
        # query i sees keys 0 .. first + i
        key_pos = torch.arange(first + tokens, device=self.device)  # [L]
        return key_pos[None, :] <= (first + torch.arange(tokens, device=self.device))[
            :, None
        ], False  # [T, L]

    def _run_stateless(self, step: Step) -> torch.Tensor:
        """A step without a session: causal attention over its own tokens, nothing cached."""
        h = step.hidden.to(self.device)[None]  # [1, T, H]
        position_ids = torch.arange(h.shape[1], device=self.device)[None]  # [1, T]
        cos, sin = self.rotary(h, position_ids)
        for layer in range(step.start, step.end):
            h = self._layer(layer, h, cos, sin, None)
        return h[0]

    def _layer(
        self,
        layer: int,
        h: torch.Tensor,  # [1, N, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        ragged: _Ragged | None,  # None: one stateless step, causal over its own tokens
    ) -> torch.Tensor:
        block: Any = self.layers[layer - self.range.start]  # a transformers *DecoderLayer
        attn = block.self_attn
        tokens = h.shape[1]
        num_heads, num_kv, head_dim = self.spec.num_heads, self.spec.num_kv_heads, self.head_dim

        x = block.input_layernorm(h)  # [1, N, H]
        # q [1, nh, N, hd]; k, v [1, nkv, N, hd]
        q, k, v = self._projections(x, (attn.q_proj, attn.k_proj, attn.v_proj))
        q = q.view(1, tokens, num_heads, head_dim).transpose(1, 2)
        k = k.view(1, tokens, num_kv, head_dim).transpose(1, 2)
        v = v.view(1, tokens, num_kv, head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        gqa = num_kv != num_heads

        if ragged is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=tokens > 1, scale=attn.scaling, enable_gqa=gqa
            )  # [1, nh, N, hd]
        else:
            # Per step, its T queries over its own cache (past + its new keys): no padding across steps.
            outs, offset = [], 0
            for cache, size, (mask, causal) in zip(
                ragged.caches, ragged.sizes, ragged.attention, strict=True
            ):
                keys, values = cache.append(
                    layer, k[0, :, offset : offset + size], v[0, :, offset : offset + size]
                )
                outs.append(
                    F.scaled_dot_product_attention(
                        q[:, :, offset : offset + size],  # [1, nh, T, hd]
                        keys[None],  # [1, nkv, L, hd]
                        values[None],
                        attn_mask=mask,
                        is_causal=causal,
                        scale=attn.scaling,
                        enable_gqa=gqa,
                    )
                )
                offset += size
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, nh, N, hd]
        out = out.transpose(1, 2).reshape(1, tokens, num_heads * head_dim)  # [1, N, nh * hd]
        h = h + self._project(out, attn.o_proj)
        # the gated MLP of transformers' *MLP, written out
        mlp, x = block.mlp, block.post_attention_layernorm(h)
        gate, up = self._projections(x, (mlp.gate_proj, mlp.up_proj))
        gated = mlp.act_fn(gate) * up
        return h + self._project(gated, mlp.down_proj)

    def _project(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """A projection in the form this CPU runs fastest for x's rows (swarm.models.matmul)."""
        return project(x, layer, self.forms, self._packed.get(id(layer.weight)))

    def _projections(self, x: torch.Tensor, layers: Sequence[nn.Linear]) -> list[torch.Tensor]:
        """``[self._project(x, layer) for layer in layers]``, as one product where their weights are packed
        together (swarm.models.matmul.packed_together)."""
        weights = [layer.weight for layer in layers]
        together = self._together.get(id(weights[0]))
        out = linear_together(x, weights, self.forms, together)
        return out if out is not None else [self._project(x, layer) for layer in layers]


def _same_input(block: nn.Module) -> list[list[torch.Tensor]]:
    """A decoder layer's projections that read the same input: q, k, v; the MLP's gate and up. Only those
    without a bias (a packed product adds none)."""
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    groups = []
    for owner, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
        linears: list[nn.Linear] = [
            layer for name in names if isinstance(layer := getattr(owner, name, None), nn.Linear)
        ]
        if len(linears) == len(names) and all(layer.bias is None for layer in linears):
            groups.append([layer.weight for layer in linears])
    return groups


@dataclass(frozen=True)
class _Ragged:
    """The steps of one batch as seen by attention: each step's cache, token count and (mask, is_causal)."""

    caches: list[SessionCache]
    sizes: list[int]
    attention: list[tuple[torch.Tensor | None, bool]]
