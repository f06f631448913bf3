"""Weights of the form a GGUF Q4_1 checkpoint holds, for tests of the CPU backend's 4-bit weights on small random models."""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 32  # weights of a row sharing one scale and minimum
LEVELS = 15  # q runs 0 .. 15


def four_bit(weight: torch.Tensor) -> torch.Tensor:
    """What a Q4_1 quantizer and transformers' widening make of a float32 weight [N, K] (K a multiple of 32):
    per block of 32, q = round((w - min) / d) with d = (max - min) / 15, d and min kept as float16, and the
    weight widened back as d * q + min in float32."""
    rows, columns = weight.shape
    blocks = weight.detach().float().reshape(rows, columns // BLOCK, BLOCK)
    least = blocks.amin(-1, keepdim=True)
    scale = (blocks.amax(-1, keepdim=True) - least) / LEVELS
    levels = torch.trunc((blocks - least) / torch.where(scale == 0, 1.0, scale) + 0.5).clamp(0, LEVELS)
    return (scale.half().float() * levels + least.half().float()).reshape(rows, columns)


@torch.no_grad()
def make_four_bit(model: nn.Module) -> nn.Module:
    """``model`` with the weight of every nn.Linear whose input is a multiple of 32 wide made 4-bit, in place."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.in_features % BLOCK == 0:
            module.weight.copy_(four_bit(module.weight))
    return model
