"""Layers whose projections bitsandbytes holds quantized (int8, nf4), on any device: the generic torch block with
each projection computed by its bitsandbytes module (swarm/models/quant.py). A CPU's own kernels never run
these (they need the float32 weights); where bitsandbytes has faster kernels (a GPU), they come with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarm.models.backends.base import RangeKernels, Shape, held_bytes
from swarm.models.backends.generic import TorchBackend, TorchRange
from swarm.models.quant import quantize_linears, stats_bytes


class QuantRange(TorchRange):
    """The torch block; a projection is its bitsandbytes module's forward."""

    def project(self, x: torch.Tensor, layer: Any) -> torch.Tensor:
        return layer(x)


class QuantBackend(TorchBackend):
    """Weights quantized at load through bitsandbytes (``kind``: int8 or nf4), computed in ``dtype``."""

    def __init__(self, kind: str, device: torch.device, dtype: torch.dtype) -> None:
        self.kind, self.device, self.dtype = kind, device, dtype
        self.name = f"bitsandbytes-{kind}"

    def hold(self, layer: nn.Module) -> nn.Module:
        return quantize_linears(layer, self.kind, self.device, self.dtype)

    def held_bytes(self, modules: Sequence[nn.Module]) -> int:
        return held_bytes(modules) + stats_bytes(modules)

    def range_kernels(
        self, layers: Sequence[nn.Module], first_layer: int, shape: Shape, pack_bytes: int
    ) -> RangeKernels:
        return QuantRange(layers, first_layer, shape)


__all__ = ["QuantBackend", "QuantRange"]
