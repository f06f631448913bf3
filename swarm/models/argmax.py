"""``ArgmaxScreen``: the greedy token from an int8 copy of the LM head, checked in float32 where it could differ.

A greedy step needs only the argmax of the logits, not all of them. The float32 LM head reads 113 MB per call
for SmolLM2-135M (49152 x 576), about 3 ms of one EPYC core: on the client, in every decode step, and on the
critical path of a session's token. Screening with an int8 copy (per-row scales, 28 MB) through torch's
weight-only int8 kernel takes ~1.5 ms; a proven bound on each row's screening error then names the rows that
can still be the argmax, and those few (typically under ten) are computed exactly in float32 from the original
weights. The greedy token is the argmax of the exact float32 logits, so greedy outputs stay those of
transformers (tests/unit/models/test_argmax.py).

The bound. With x the normed hidden row (float32), xb = bf16(x), w_j row j of the head, q_j its int8 copy and
s_j its bf16 scale, the kernel returns a_j = bf16(sum_i xb_i q_ij s_j), accumulated in float32. Then

    |x . w_j - a_j| <=  |x - xb|_1 max|w_j|                 (rounding x to bf16)
                      + |xb|_1 max|w_j - q_j s_j|           (quantising w_j)
                      + 2^-8 |xb|_1 max|w_j| (1 + 2^-7)     (a kernel that rounds q_j s_j to bf16 first)
                      + H 2^-22 (|x|_1 + |xb|_1) max|w_j|   (float32 sums: the kernel's, and the reference's own)
                      + 2^-8 |a_j|                          (the bf16 result)

A row j with a_j + bound_j below max_k (a_k - bound_k) is below that row k exactly, so it is not the argmax.
The kept rows get their float32 logits; every other entry of the returned row is -inf (only its argmax is
meaningful, which is all a greedy pick reads).

Whether screening pays is measured, not assumed: torch's int8 kernel is fast where the CPU has bf16 dot
products (AVX512-BF16, AMX) and slow elsewhere, and for many rows the dense head's cost per row falls. So
``ClientHead`` times both on its own weights and screens only up to the row count where it is clearly faster.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

ROWS_TIMED = (1, 2, 4, 8)  # calibration: screening is kept for row counts up to the last one clearly faster
CLEARLY_FASTER = 0.9  # the screen must take at most this share of the dense head's time
_REPEATS = 7
# past this share of the vocabulary kept, a row's float32 re-check would cost more than the dense head's row
MOST_KEPT = 1 / 32


class ArgmaxScreen:
    """An int8 copy of an LM head weight [V, H] (float32, CPU), and the bound that makes its argmax exact."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.ndim != 2:
            raise ValueError("ArgmaxScreen takes a 2-D float32 CPU weight")
        if not screen_available(weight.shape[1]):
            raise ValueError(f"no int8 screen for rows of {weight.shape[1]} (see screen_available)")
        self.weight = weight  # the exact rows the kept candidates are computed from
        self.row_max = weight.abs().amax(dim=1)  # [V]
        self.scales = (self.row_max / 127).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        scales = self.scales.float()[:, None]
        self.quantised = torch.round(weight / scales).clamp(-127, 127).to(torch.int8)  # [V, H]
        self.quantisation_error = (weight - self.quantised.float() * scales).abs().amax(dim=1)  # [V]
        self._sum_rounding = weight.shape[1] * 2.0**-22

    def logits(self, normed: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """normed [N, H] float32 -> [N, V]: float32 logits at the rows that can be the argmax, -inf elsewhere.

        A row whose screen keeps too many candidates (a flat distribution) gets all its logits from ``dense``
        instead, so screening never costs much more than the dense head."""
        screened, bound = self.bounds(normed)
        floor = (screened - bound).amax(dim=1, keepdim=True)  # some row's exact logit is at least this
        keep = screened + bound >= floor  # [N, V]
        counts = keep.sum(dim=1)  # [N]
        flat = counts > self.weight.shape[0] * MOST_KEPT  # [N]
        keep[flat] = False
        counts[flat] = 0
        out = torch.full_like(screened, float("-inf"))
        _, tokens = keep.nonzero(as_tuple=True)  # the kept vocabulary rows of every input row, in row order
        kept = tokens.split(counts.tolist())
        for r in range(normed.shape[0]):
            if flat[r]:
                out[r] = dense(normed[r : r + 1])[0]
            else:  # one input row at a time, as transformers computes a decode step: the same float32 products
                out[r, kept[r]] = F.linear(normed[r : r + 1], self.weight.index_select(0, kept[r]))[0]
        return out

    def bounds(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """normed [N, H] -> (screened logits [N, V], a bound [N, V] on each one's distance from the exact one)."""
        rows_bf16 = normed.to(torch.bfloat16)
        screened = torch._weight_int8pack_mm(rows_bf16, self.quantised, self.scales).float()
        rounded = rows_bf16.float()
        xb_norm = rounded.abs().sum(dim=1, keepdim=True)  # [N, 1]
        per_max = (  # the terms that scale with a row's largest weight (module docstring)
            (normed - rounded).abs().sum(dim=1, keepdim=True)
            + xb_norm * 2.0**-8 * (1 + 2.0**-7)  # |q_j s_j| <= max|w_j| (1 + 2^-8)
            + (normed.abs().sum(dim=1, keepdim=True) + xb_norm) * self._sum_rounding
        )
        return screened, self.row_max * per_max + self.quantisation_error * xb_norm + screened.abs() * 2.0**-8


def screened_rows(
    dense: Callable[[torch.Tensor], torch.Tensor],
    screen: ArgmaxScreen,
    sample: torch.Tensor,
    clock: Callable[[], float] = time.perf_counter,
) -> int:
    """The most rows (of ROWS_TIMED) up to which ``screen`` is clearly faster than ``dense`` at every row count
    timed, on ``sample`` [max(ROWS_TIMED), H] normed rows like the model's last hidden states, whose logits
    have a clear top (random rows have flat logits, which keep thousands of candidates) (0: never)."""
    rows_kept = 0
    for rows in ROWS_TIMED:
        x = sample[:rows]
        dense_s = _best_time(functools.partial(dense, x), clock)
        screen_s = _best_time(functools.partial(screen.logits, x, dense), clock)
        logger.debug(
            "LM head, %d rows: dense %.2f ms, int8 screen %.2f ms", rows, dense_s * 1e3, screen_s * 1e3
        )
        if screen_s > CLEARLY_FASTER * dense_s:
            break
        rows_kept = rows
    if rows_kept:
        logger.info(
            "greedy steps of up to %d rows take the LM head's argmax through an int8 screen", rows_kept
        )
    return rows_kept


def _best_time(run: Callable[[], object], clock: Callable[[], float]) -> float:
    run()  # warm up (kernel selection, page faults on the copy)
    best = float("inf")
    for _ in range(_REPEATS):
        started = clock()
        run()
        best = min(best, clock() - started)
    return best


def screen_available(hidden_size: int) -> bool:
    """Whether this torch has the weight-only int8 kernel the screen runs on, for rows of ``hidden_size``: its
    CPU kernel reads the rows in blocks of 16 (32 for AVX2) without checking the end (torch 2.13: garbage or a
    crash for 40)."""
    return hasattr(torch, "_weight_int8pack_mm") and hidden_size % 32 == 0
