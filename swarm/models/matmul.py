"""``linear``: ``F.linear`` with the form of the product chosen for the few rows of a decode step on a CPU.

Decoding is bound by reading the weights once per step, so a projection of 1 to 4 rows should cost about one
pass over them. On this project's test machine (AMD EPYC, torch 2.13's MKL, one thread) ``F.linear`` does not get
there for few rows. The projections of 10 layers of SmolLM2-135M (142 MB, ``scripts/bench_matmul.py``) take
11.9 ms for 1 row (12 GB/s), 18.6 ms for 2 and 23.5 ms for 3; the same products written as ``weight @ x.T``
(MKL's kernel for a few columns) take 9.5 ms for 2 rows (15 GB/s) and 15.0 ms for 3. One row goes through that
kernel as two (the row twice: with one column MKL falls back to the slow kernel), also in 9.5 ms, and the client's
LM head (113 MB) in 6.3 ms instead of 9.8. At 4 rows the two forms are close (16.5 against 17.9 ms) and past
that ``F.linear`` is as fast or faster.

Only the summation order differs from ``F.linear`` (each output is the same dot product), so outputs agree with
transformers' to float rounding and greedy tokens are those of transformers (the exactness tests). GPUs, other
dtypes and longer inputs use ``F.linear`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_FEW_ROWS = 4  # up to this many rows take the few-columns kernel (see the module doc for the measurements)


def few_rows_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` computes ``x @ weight.T`` as ``weight @ x.T`` (CPU, float32, 1 to MAX_FEW_ROWS rows)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        0 < rows <= MAX_FEW_ROWS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] and weight [N, K]: [..., N]."""
    if not few_rows_kernel(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat((rows, rows))  # one column would take the slow kernel (see the module doc)
    out = (weight @ rows.T).T[:count]  # [M, N]; rows.T is a view: the layout this kernel is fast with
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)`` for a transformers ``nn.Linear`` projection, through ``linear``."""
    return linear(x, layer.weight, layer.bias)
