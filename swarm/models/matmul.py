"""``linear``: ``F.linear``, or for the few rows of a decode step the form of the product this CPU runs faster.

Decoding is bound by reading the weights once per step, so a projection of 1 to 4 rows should cost about one
pass over them. Whether ``F.linear`` gets there depends on the CPU and its BLAS, so it is measured, not assumed
(``calibrate``, once per process and set of weight shapes). On an AMD EPYC (torch 2.13's MKL, one thread) the
projections of 10 layers of SmolLM2-135M (142 MB, ``scripts/bench_matmul.py``) take 11.9 ms for 1 row and 18.6
ms for 2 through ``F.linear``, but 9.5 ms for both written as ``weight @ x.T`` (MKL's kernel for a few columns;
one row goes through it as two, since with one column MKL falls back to the slow kernel), and the LM head 6.3 ms
instead of 9.8. On an Intel Sapphire Rapids the same products are the other way round: ``F.linear`` takes 10.7 ms
for 1 row and the few-columns form 24.9 ms. So each ``BlockRange`` and ``ClientHead`` times both forms on its
own weights when it is made and keeps the number of rows up to which the few-columns form is clearly faster
(0: never).

Only the summation order differs from ``F.linear`` (each output is the same dot product), so outputs agree with
transformers' to float rounding and greedy tokens are those of transformers (the exactness tests). GPUs, other
dtypes and longer inputs use ``F.linear`` itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

MAX_FEW_ROWS = 4  # past this many rows F.linear was never slower on the machines measured
CALIBRATION_BYTES = 96 * 2**20  # weights timed per form: more than a CPU's caches hold, as in a decode step
CLEARLY_FASTER = 0.9  # the few-columns form is kept only where it takes at most this share of F.linear's time


def few_rows_kernel(x: torch.Tensor, weight: torch.Tensor, few_rows: int) -> bool:
    """Whether ``linear`` computes ``x @ weight.T`` as ``weight @ x.T``: CPU float32, 1 to few_rows rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        0 < rows <= few_rows
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def _few_columns(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ weight.T as weight @ rows.T: [M, N]."""
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat((rows, rows))  # one column would take the slow kernel (see the module doc)
    return (weight @ rows.T).T[:count]  # rows.T is a view: the layout this kernel is fast with


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, few_rows: int = 0
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] and weight [N, K]: [..., N]. Inputs of 1 to few_rows rows
    take the few-columns form (``calibrate`` says how many rows that is worth on this CPU)."""
    if not few_rows_kernel(x, weight, few_rows):
        return F.linear(x, weight, bias)
    out = _few_columns(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(x: torch.Tensor, layer: torch.nn.Linear, few_rows: int = 0) -> torch.Tensor:
    """``layer(x)`` for a transformers ``nn.Linear`` projection, through ``linear``."""
    return linear(x, layer.weight, layer.bias, few_rows)


def few_rows_limit(seconds_by_rows: dict[int, tuple[float, float]]) -> int:
    """From {rows: (F.linear seconds, few-columns seconds)}: the most rows M such that for every row count up
    to M the few-columns form took at most CLEARLY_FASTER of F.linear's time (0 if not even for one row)."""
    limit = 0
    for rows in sorted(seconds_by_rows):
        plain, few_columns = seconds_by_rows[rows]
        if rows != limit + 1 or few_columns > CLEARLY_FASTER * plain:
            break
        limit = rows
    return limit


_calibrated: dict[tuple[object, ...], int] = {}
_calibration_lock = threading.Lock()


def calibrate(
    weights: Sequence[torch.Tensor],
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """How many rows (0 to MAX_FEW_ROWS) should take the few-columns form for these weights on this CPU.

    Times one pass over a sample of the weights (each shape once, then more up to CALIBRATION_BYTES) per form and
    row count, best of ``repeats``. The answer is a fact of the machine and the weight shapes, so it is kept per
    process and set of shapes: every layer of a model has the same set, so a peer that re-loads other layers of
    its model or a test that makes many ranges pays for it once."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    weights = [w.detach() for w in weights]
    if not weights or any(w.device.type != "cpu" or w.dtype != torch.float32 or w.ndim != 2 for w in weights):
        return 0
    key = (torch.get_num_threads(), *sorted({tuple(w.shape) for w in weights}))
    known = _calibrated.get(key)
    if known is not None:
        return known
    with _calibration_lock:  # two loaders at once would time each other's memory traffic
        if key not in _calibrated:
            _calibrated[key] = few_rows_limit(_time_forms(_sample(weights), repeats, clock))
            logger.info(
                "matmul: the few-columns form for %s (measured on this CPU)",
                f"up to {_calibrated[key]} rows" if _calibrated[key] else "no row count",
            )
        return _calibrated[key]


def _sample(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """One weight of each shape, then the rest in order, until CALIBRATION_BYTES; each cut to that many bytes
    (its first rows: still a contiguous matrix of the same row length)."""
    by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for weight in weights:
        by_shape.setdefault(tuple(weight.shape), weight)
    first_of_shape = list(by_shape.values())
    taken: list[torch.Tensor] = []
    seen: set[int] = set()
    size = 0
    for weight in [*first_of_shape, *weights]:
        if size >= CALIBRATION_BYTES and len(taken) >= len(first_of_shape):
            break
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        row_bytes = weight.shape[1] * weight.element_size()
        rows = max(1, min(weight.shape[0], CALIBRATION_BYTES // max(1, row_bytes)))
        taken.append(weight[:rows])
        size += rows * row_bytes
    return taken


def _time_forms(
    weights: list[torch.Tensor], repeats: int, clock: Callable[[], float]
) -> dict[int, tuple[float, float]]:
    seconds: dict[int, tuple[float, float]] = {}
    with torch.no_grad():
        for rows in range(1, MAX_FEW_ROWS + 1):
            # fixed values, not the global RNG: loading a model must not change what a seeded caller draws next
            inputs = {w.shape[1]: torch.full((rows, w.shape[1]), 0.5) for w in weights}
            forms: tuple[Product, Product] = (F.linear, _few_columns)
            best = [float("inf"), float("inf")]
            for attempt in range(repeats + 1):  # the first pass of each form warms up and is not counted
                for index, form in enumerate(forms):  # interleaved: a slow spell of the machine hits both
                    began = clock()
                    for weight in weights:
                        form(inputs[weight.shape[1]], weight)
                    elapsed = clock() - began
                    if attempt:
                        best[index] = min(best[index], elapsed)
            seconds[rows] = (best[0], best[1])
    return seconds
