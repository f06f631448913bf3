"""A range's layers on a CPU in float32: the generic torch layer with its products in the form this CPU runs
fastest (swarm.models.backends.cpu.matmul), and steps of few tokens through whole layers in one C call where
the layers are held as 4-bit (swarm.models.backends.cpu.int4's decode_layers).

Weights held as 4-bit (held.py) have no float32 copy: a product goes through the 4-bit kernel, or, for row
counts at which F.linear was clearly faster here, through F.linear over the weight widened into a scratch
buffer (the same float32 weights, so the same results as F.linear on the checkpoint's weights). Float32
weights that are not 4-bit may have packed copies beside them where the range's ``pack_bytes`` affords them.

Steps of few tokens in all (decode steps, short prefills such as spot-check windows) whose layers are all held
as 4-bit go through decode_layers, one C call per forward call (a layer a call for a prefill that gives way
between layers): the same operations without an interpreter and dispatch cost for each of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarm.models.backends.base import Batch, Shape
from swarm.models.backends.cpu import int4
from swarm.models.backends.cpu.held import Int4Linear, hold
from swarm.models.backends.cpu.matmul import (
    Forms,
    calibrate,
    calibrate_held,
    project,
    taken,
)
from swarm.models.backends.generic import TorchRange, _cut_back
from swarm.models.kv_cache import Slot

logger = logging.getLogger(__name__)


class CpuRange(TorchRange):
    """A range's held layers, with the forms of products calibrated on this CPU."""

    def __init__(self, layers: Sequence[nn.Module], first_layer: int, shape: Shape, pack_bytes: int) -> None:
        super().__init__(layers, first_layer, shape)
        held, floats = self._linears()
        if held:
            forms = calibrate_held(held)
        else:
            affordable = 0 < sum(w.numel() * w.element_size() for w in floats) <= pack_bytes
            forms = calibrate(floats, packing=affordable)
        self.use_forms(forms)

    def _linears(self) -> tuple[list[Int4Linear], list[torch.Tensor]]:
        """The projections held as 4-bit, and the float32 weights of the others."""
        modules = [m for layer in self.layers for m in layer.modules()]
        held = [m for m in modules if isinstance(m, Int4Linear)]
        return held, [m.weight for m in modules if isinstance(m, nn.Linear)]

    def use_forms(self, forms: Forms) -> None:
        """Take ``forms`` from now on (on the torch thread, or before serving). With the 4-bit packer, weights
        that are exactly 4-bit are held as 4-bit first; copies of the other weights are kept only if ``forms``
        use them."""
        if forms.packer == "int4":
            for layer in self.layers:
                hold(layer)
        held, floats = self._linears()
        self.forms = forms
        # the float32 weights' own forms: a 4-bit form they cannot take leaves the few-columns form
        self.float_forms, self._packed = taken(forms, floats)
        # the projections held as 4-bit together, by their first module (one product each)
        self._together: dict[int, torch.Tensor] = {
            id(group[0]): group[0].together
            for group in _groups(self.layers)
            if isinstance(group[0], Int4Linear)
            and group[0].together is not None
            and all(isinstance(m, Int4Linear) and m.together is group[0].together for m in group)
        }
        # each layer as int4.decode_layers takes it, where it can (None: its steps go through the torch layer)
        self._fused = [self._fused_weights(block) for block in self.layers]
        self._layer_runs: dict[tuple[int, int], int4.LayerRun] = {}  # by [start, end): _layer_run
        self._attention = int4.Attention(
            self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim, self.shape.scale
        )
        # where F.linear is faster than the 4-bit kernel: each widened weight in turn, made on first use
        self._widest = max((m.out_features * m.in_features for m in held), default=0)
        self._scratch: torch.Tensor | None = None

    def _fused_weights(self, block: Any) -> int4.LayerWeights | None:
        """The layer's weights for int4.decode_layers: a Llama-family layer (RMSNorms, SiLU-gated MLP, no biases,
        no norms of q and k) whose projections are all held as 4-bit, q, k, v and gate, up together."""
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        norms: list[Any] = [getattr(block, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if attn is None or mlp is None or not self.shape.silu or not int4.takes_head_dim(self.shape.head_dim):
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
        qkv, gate_up = self._together.get(id(attn.q_proj)), self._together.get(id(mlp.gate_proj))
        o, down = attn.o_proj, mlp.down_proj
        if (
            qkv is None
            or gate_up is None
            or not isinstance(o, Int4Linear)
            or not isinstance(down, Int4Linear)
        ):
            return None
        if o.bias is not None or down.bias is not None:
            return None
        return int4.LayerWeights(
            weights[0],
            weights[1],
            float(norms[0].variance_epsilon),
            qkv,
            o.packed,
            gate_up,
            down.packed,
            int(down.in_features),
        )

    def same_form(self, rows: int, more_rows: int) -> bool:
        return self.forms.form(rows) == self.forms.form(rows + more_rows)

    def form(self, rows: int) -> str:
        fused = bool(self._fused) and all(w is not None for w in self._fused)
        return "int4 fused" if fused and self.forms.packs(rows) else self.forms.form(rows)

    # --- forward ------------------------------------------------------------------------------------------

    def run(self, batch: Batch, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        if self._fusable(batch):
            return self._run_fused(batch, between_layers)
        return super().run(batch, between_layers)

    def _fusable(self, batch: Batch) -> bool:
        """Whether these steps go through int4.decode_layers: as many tokens in all as the 4-bit form takes
        (decode steps, short prefills such as spot-check windows, and both in one call) and every layer fused."""
        first = self.first_layer
        return self.forms.packs(sum(batch.sizes)) and all(
            w is not None for w in self._fused[batch.start - first : batch.end - first]
        )

    def _run_fused(self, batch: Batch, between_layers: Callable[[], None] | None) -> torch.Tensor:
        """run for steps of few tokens through int4.decode_layers: the whole range in one call, or a layer a call
        where ``between_layers`` gives way between them. A step's tokens are rows at consecutive positions of
        one cache: each row attends to the rows before it, which the call has cached by then, so a step of
        several tokens is causal as in the torch layer."""
        h = batch.hidden.contiguous()  # [N, H], changed in place
        start, end = batch.start, batch.end
        # what each step's cache grows by
        likes = {
            size: torch.empty(self.shape.num_kv_heads, size, self.shape.head_dim) for size in set(batch.sizes)
        }

        def slots(layer: int) -> list[Slot]:
            reserved: list[Slot] = []
            for cache, size in zip(batch.caches, batch.sizes, strict=True):
                slot = cache.slot(layer, likes[size])
                if size == 1:
                    reserved.append(slot)
                else:
                    reserved.extend(slot._replace(length=slot.length + i) for i in range(size))
            return reserved

        before = [[cache.length(layer) for layer in range(start, end)] for cache in batch.caches]
        try:
            if between_layers is None:  # the whole range in one call
                run = self._layer_run(start, end)
                all_slots = [slots(layer) for layer in range(start, end)]
                int4.decode_layers(h, run, self._attention, batch.cos, batch.sin, all_slots)
            else:
                for layer in range(start, end):
                    if layer > start:
                        between_layers()
                    run = self._layer_run(layer, layer + 1)
                    int4.decode_layers(h, run, self._attention, batch.cos, batch.sin, [slots(layer)])
        except BaseException:
            # reserved tokens that were not written (all layers are reserved before the call) must not count as
            # cached: a later step would attend to garbage instead of being told to replay
            _cut_back(batch, before)
            raise
        return h

    def _layer_run(self, start: int, end: int) -> int4.LayerRun:
        """The fused layers [start, end) as one int4.LayerRun, gathered on first use (and again if they
        changed)."""
        first = self.first_layer
        layers = [w for w in self._fused[start - first : end - first] if w is not None]
        assert len(layers) == end - start, "every layer of a fused run is fused (_fusable)"
        run = self._layer_runs.get((start, end))
        if run is None or not run.of(layers):
            run = self._layer_runs[(start, end)] = int4.LayerRun(layers)
        return run

    def project(self, x: torch.Tensor, layer: Any) -> torch.Tensor:
        """A projection in the form this CPU runs fastest for x's rows."""
        if isinstance(layer, Int4Linear):
            rows = x.numel() // x.shape[-1]
            if self.forms.packs(rows):
                return layer(x)
            if self._scratch is None:
                self._scratch = torch.empty(self._widest)
            return F.linear(x, layer.widened(self._scratch), layer.bias)
        return project(x, layer, self.float_forms, self._packed.get(id(layer.weight)))

    def projections(self, x: torch.Tensor, layers: Sequence[Any]) -> list[torch.Tensor]:
        """The projections of one input, as one product where they are held as 4-bit together."""
        together = self._together.get(id(layers[0]))
        rows = x.numel() // x.shape[-1]
        if together is None or not self.forms.packs(rows):
            return [self.project(x, layer) for layer in layers]
        sizes = [int(layer.out_features) for layer in layers]
        out = int4.product(x.reshape(rows, x.shape[-1]), together, sum(sizes))
        return [
            part.reshape(*x.shape[:-1], size) for part, size in zip(out.split(sizes, 1), sizes, strict=True)
        ]


def _groups(layers: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """Each layer's projections that read the same input: q, k, v; the MLP's gate and up."""
    groups = []
    for block in layers:
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        for owner, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            modules = [getattr(owner, name, None) for name in names]
            if all(m is not None for m in modules):
                groups.append([m for m in modules if m is not None])
    return groups


__all__ = ["CpuRange", "hold"]
