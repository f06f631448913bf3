"""The CPU backend, float32: everything CPU-specific lives here and is imported nowhere else.

- int4.py / int4.c: weights that are exactly 4-bit (GGUF Q4_1), multiplied and run whole layers without
  widening them; held.py holds such weights as 4-bit in place of float32.
- matmul.py: the forms of a product this CPU runs fastest by row count, calibrated and kept per machine
  (kept.py).
- argmax.py / screen.c: the LM head's greedy step through an int8 screen, settled by exact logits.
- range.py, head.py: the RangeKernels and HeadKernels built from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from swarm.models.backends.base import Backend, HeadKernels, RangeKernels, Shape
from swarm.models.backends.cpu.head import CpuHead
from swarm.models.backends.cpu.held import hold
from swarm.models.backends.cpu.range import CpuRange


class CpuBackend(Backend):
    """float32 on a CPU."""

    name = "cpu"

    def hold(self, layer: nn.Module) -> nn.Module:
        """Exactly 4-bit weights held as 4-bit (held.py), in place of their float32 weights."""
        return hold(layer)

    def range_kernels(
        self, layers: Sequence[nn.Module], first_layer: int, shape: Shape, pack_bytes: int
    ) -> RangeKernels:
        return CpuRange(layers, first_layer, shape, pack_bytes)

    def head_kernels(self, weight: torch.Tensor, sample: Callable[[], torch.Tensor]) -> HeadKernels:
        return CpuHead(weight, sample)


__all__ = ["CpuBackend"]
