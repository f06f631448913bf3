"""Weights that are exactly 4-bit, held as 4-bit: an ``Int4Linear`` replaces the nn.Linear whose float32 weight
it reproduces bit for bit, at 3/16 of its bytes (swarm.models.backends.cpu.int4).

A layer is held this way once, when it is loaded (``hold``); ranges made later from the same modules (a peer
that moves or grows its range) share them, so every range a peer comes to hold runs the same form, and a memory
budget counts what is held, never a float32 copy beside it. A layer's projections that read the same input
(q, k, v; the MLP's gate and up) are packed one after another into one tensor, each module holding its view, so
that one product serves them all.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from swarm.models.backends.cpu import int4

# nn.Linear modules found not to be 4-bit, with their weight's version then: a range assembled again from them
# does not check again, unless the weight was changed in place since
_not_four_bit: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


class Int4Linear(nn.Module):
    """A projection whose weight [out_features, in_features] is held as int4.unpack's packed rows."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    together: torch.Tensor | None

    def __init__(
        self,
        packed: torch.Tensor,  # [out_features, int4.row_bytes(in_features)] uint8
        in_features: int,
        bias: torch.Tensor | None,
        together: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, int(packed.shape[0])
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # the packed rows of this projection and the others of its input, one after another (None: alone)
        self.together = together

    @classmethod
    def of(cls, linear: nn.Module) -> Int4Linear | None:
        """``linear``'s weight held as 4-bit, or None if it is not exactly 4-bit (or no kernel runs here)."""
        if isinstance(linear, Int4Linear):
            return linear
        if not isinstance(linear, nn.Linear) or not int4.available():
            return None
        if _not_four_bit.get(linear) == linear.weight._version:
            return None
        packed = int4.unpack(linear.weight.detach())
        if packed is None:
            _not_four_bit[linear] = linear.weight._version
            return None
        return cls(packed, linear.in_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = int4.product(rows, self.packed, self.out_features)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def widened(self, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight, bit for bit the one it replaced, written into ``scratch`` where it is given
        (at least out_features * in_features floats) so that repeated calls reuse one buffer."""
        size = self.out_features * self.in_features
        out = torch.empty(size) if scratch is None or scratch.numel() < size else scratch[:size]
        int4.widen(self.packed, self.out_features, self.in_features, out)
        return out.view(self.out_features, self.in_features)


def _same_input(layer: nn.Module) -> list[tuple[Any, tuple[str, ...]]]:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return [(attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))]


@torch.no_grad()
def hold(layer: nn.Module) -> nn.Module:
    """``layer`` with every nn.Linear whose weight is exactly 4-bit replaced by its Int4Linear, in place; the
    projections of one input (without biases) packed together where all of them are 4-bit."""
    grouped: set[int] = set()
    for owner, names in _same_input(layer):
        linears: list[Any] = [getattr(owner, name, None) for name in names]
        if owner is None or not all(isinstance(m, nn.Linear | Int4Linear) for m in linears):
            continue
        if all(isinstance(m, Int4Linear) for m in linears) or any(m.bias is not None for m in linears):
            continue
        held = [Int4Linear.of(m) for m in linears]
        if any(h is None for h in held):
            continue
        together = torch.cat([h.packed for h in held if h is not None])  # [q + k + v rows, row bytes]
        start = 0
        for name, h in zip(names, held, strict=True):
            assert h is not None
            view = together[start : start + h.out_features]
            setattr(owner, name, Int4Linear(view, h.in_features, None, together))
            grouped.add(id(getattr(owner, name)))
            start += h.out_features
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child) not in grouped:
                alone = Int4Linear.of(child)
                if alone is not None:
                    setattr(parent, name, alone)
    return layer
