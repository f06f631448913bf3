"""BlockRange: runs transformer layers [start, end) for a batch of sessions, each with its own KV cache.

BlockRange keeps the sessions, checks every step and groups them; the layers run on the range's device through
its backend (swarm.models.backends: the Llama block written out in torch ops, or a device's faster form of it),
chosen once from the device and dtype. The weights are held in the backend's form from the moment a layer is
loaded (a CPU holds exactly 4-bit weights as 4-bit), so a range made from layers another range already holds
(a peer that moves) runs exactly as one loaded at join.

One forward() call takes a list of Steps. Steps of different sessions that cover the same sub-range run as ONE
batch, whatever their lengths (decode steps of one token and prefill chunks mixed, as Sarathi does): norms,
projections and MLP see all their tokens at once (the weights are read once, which is what decode speed is bound
by), attention runs per step over its own session's cache. Stateless steps (no session) run one by one. A
BlockRange is not thread-safe: one executor thread owns it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.models.backends import Batch, Shape, for_device
from swarm.models.kv_cache import KVCache, SessionCache
from swarm.models.spec import ModelSpec
from swarm.types import LayerRange

logger = logging.getLogger(__name__)

_CLASS_PREFIX = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
}
_MODULE = {"gemma3_text": "gemma3"}  # model types whose classes live in another model type's module


def family_classes(model_type: str) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module]]:
    """(DecoderLayer, RotaryEmbedding, RMSNorm) classes of a transformers model_type."""
    prefix = _CLASS_PREFIX.get(model_type)
    if prefix is None:
        raise ValueError(f"unsupported model_type {model_type!r}: FlowSwarm runs {', '.join(_CLASS_PREFIX)}")
    name = _MODULE.get(model_type, model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
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
        quant: str = "none",
    ) -> None:
        """``pack_bytes``: memory this range may spend on copies of its weights beside them, where its backend
        has a faster form that needs one (a CPU's packed float32 weights); 0 keeps none. ``quant``: how its
        projections are held (swarm.types.QUANT_KINDS; swarm/models/quant.py)."""
        if len(layers) != len(layer_range):
            raise ValueError(f"got {len(layers)} layers for range {layer_range}")
        _, rotary_class, _ = family_classes(spec.model_type)
        self.spec = spec
        self.range = layer_range
        self.device = device
        self.dtype = dtype
        self.quant = quant
        rotary = rotary_class(config=config).to(device)
        # a RoPE per layer type (Gemma 3): the batch's angles are the full-attention layers' (the kernels turn
        # the others' themselves)
        per_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self.rotary = functools.partial(rotary, layer_type="full_attention") if per_type else rotary
        self.head_dim = int(getattr(config, "head_dim", None) or spec.hidden_size // spec.num_heads)
        self.cache = KVCache(layer_range, cache_tokens)
        attn: Any = getattr(layers[0], "self_attn", None) if len(layers) else None
        shape = Shape(
            spec.num_heads,
            spec.num_kv_heads,
            self.head_dim,
            float(getattr(attn, "scaling", self.head_dim**-0.5)),
            getattr(config, "hidden_act", None) in ("silu", "swish"),
        )
        # the weights in the form this device holds them (a no-op for layers held so already)
        self.backend = for_device(device, dtype, quant, spec.model_type)
        self.layers = nn.ModuleList([self.backend.hold(layer) for layer in layers])
        self.kernels = self.backend.range_kernels(list(self.layers), layer_range.start, shape, pack_bytes)
        # Kernels that are not ``windowed`` attend over the whole context; a sliding-window model (Mistral v0.1)
        # would see less past that window, so their sessions longer than it are refused rather than silently
        # computed differently.
        window = getattr(config, "sliding_window", None)
        self.max_context_tokens: int | None = int(window) if window and not self.kernels.windowed else None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this range holds (shared with other ranges of the same modules)."""
        return self.backend.held_bytes(list(self.layers))

    def same_form(self, rows: int, more_rows: int) -> bool:
        """Whether ``more_rows`` more rows leave a forward call of ``rows`` in the same form of products."""
        return self.kernels.same_form(rows, more_rows)

    # --- sessions -----------------------------------------------------------------------------------------

    def open_session(self, session_id: str, max_length_tokens: int) -> None:
        """Open a session of at most max_length_tokens; its cache is taken as its steps come (kv_cache)."""
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
        needed = old.cache.held_tokens(carried)
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
        """Cache tokens a new session can have now: free blocks and those of sessions idle enough to evict."""
        return self.cache.available_tokens

    @property
    def active_sessions(self) -> list[str]:
        return self.cache.session_ids

    def check_not_evicted(self, session_id: str, position: int) -> None:
        """SessionEvicted if the session lost its cache here and the step at ``position`` needs it."""
        self.cache.check_not_evicted(self.cache.get(session_id), position)

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
        self.cache.check_not_evicted(session, step.position)
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
        sessions = {sid: self.cache.get(sid) for sid in seen}
        homes: dict[KVCache, list[str]] = {}  # a session carried to a wider range keeps its blocks there
        for sid, session in sessions.items():
            homes.setdefault(session.home, []).append(sid)
        with contextlib.ExitStack() as stack:
            for home, ids in homes.items():  # none of them is evicted by the other lane's thread meanwhile
                stack.enter_context(home.stepping(ids))
            return self._forward(steps, sessions, homes, between_layers)

    def _forward(
        self,
        steps: Sequence[Step],
        sessions: dict[str, SessionCache],
        homes: dict[KVCache, list[str]],
        between_layers: Callable[[], None] | None,
    ) -> list[torch.Tensor]:
        for step in steps:  # only now change state: cut caches back to each step's position
            if step.session_id is not None:
                session = sessions[step.session_id]
                session.evicted = False  # at position 0 (validate): it starts afresh
                session.cut({layer: step.position for layer in range(step.start, step.end)})
        shared: dict[int, torch.Tensor] = {}  # step index -> outputs of the prefix rows it shared
        if self.cache.share_prefixes:
            steps, shared = self._share_prefixes(steps)
        # blocks for every step's tokens, taken back from idle sessions if need be (CapacityError if not)
        tokens = {s.session_id: s.position + s.hidden.shape[0] for s in steps if s.session_id is not None}
        for home, ids in homes.items():
            home.prepare({sid: tokens[sid] for sid in ids})

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
        done = [out for out in outputs if out is not None]
        if self.cache.share_prefixes:
            for i, step in enumerate(steps):
                if step.session_id is not None and (step.start, step.end) == (
                    self.range.start,
                    self.range.end,
                ):
                    session = sessions[step.session_id]
                    self.cache.register_prefix(session, step.position, step.hidden, done[i])
            done = [torch.cat([shared[i], out]) if i in shared else out for i, out in enumerate(done)]
        return done

    def _share_prefixes(self, steps: Sequence[Step]) -> tuple[list[Step], dict[int, torch.Tensor]]:
        """Steps through all our layers whose first full blocks others computed from the same inputs: those
        blocks shared (kv_cache.KVCache.attach_prefix), the steps cut to the rows after them."""
        kept, shared = list(steps), {}
        for i, step in enumerate(steps):
            if step.session_id is None or (step.start, step.end) != (self.range.start, self.range.end):
                continue
            session = self.cache.get(step.session_id)
            prefix = self.cache.attach_prefix(session, step.position, step.hidden)
            if prefix is not None:
                rows = prefix.shape[0]
                kept[i] = Step(
                    step.session_id, step.hidden[rows:], step.start, step.end, step.position + rows
                )
                shared[i] = prefix
        return kept, shared

    def _run(self, steps: list[Step], between_layers: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Session steps with the same [start, end), any number of tokens each (decode steps and prefill chunks
        alike), as one batch through the backend's kernels."""
        sizes = [s.hidden.shape[0] for s in steps]
        h = torch.cat([s.hidden.to(self.device) for s in steps])  # [N, H]
        position_ids = torch.cat(
            [
                torch.arange(s.position, s.position + t, device=self.device)
                for s, t in zip(steps, sizes, strict=True)
            ]
        )[None]  # [1, N]
        cos, sin = self.rotary(h[None], position_ids)  # [1, N, head_dim] each, in h's dtype
        batch = Batch(
            h,
            cos[0],
            sin[0],
            [self.cache.get(s.session_id or "") for s in steps],
            sizes,
            [s.position for s in steps],
            steps[0].start,
            steps[0].end,
        )
        return list(self.kernels.run(batch, between_layers).split(sizes))

    def _run_stateless(self, step: Step) -> torch.Tensor:
        """A step without a session: causal attention over its own tokens, nothing cached."""
        h = step.hidden.to(self.device)  # [T, H]
        position_ids = torch.arange(h.shape[0], device=self.device)[None]  # [1, T]
        cos, sin = self.rotary(h[None], position_ids)
        return self.kernels.run_stateless(h, cos[0], sin[0], step.start, step.end)
