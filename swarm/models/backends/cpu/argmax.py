"""Screens: the greedy token from an int8 copy of the LM head, checked in float32 where it could differ.

A greedy step needs only the argmax of the logits, not all of them. The float32 LM head is read whole in every
decode step (113 MB for SmolLM2-135M, 49152 x 576), on the client and on the critical path of a session's token.
A screen computes every logit from int8 weights (a quarter of the bytes) with a proven bound on each one's error;
the rows whose bound still lets them reach the top (typically a few) are then computed exactly from the original
weights.

What "exact" means: the greedy token is the argmax of ``exact_logits``, the float32 dot products of the normed
row with each row of the head, summed in one fixed order (screen.c's dot_rows). A logit is the same bits whichever
other rows are computed with it and on every x86 CPU, so the re-check of a screen's candidates and the reference
agree by construction. F.linear's logits differ from these only by float rounding (its kernel and so its order of
the sums depend on the CPU and the shape), so greedy outputs stay those of transformers
(tests/unit/models/backends/cpu/test_argmax.py).

Two screens, for two kinds of CPU (``ClientHead`` times both on its own weights and keeps the faster):

``Int8WeightScreen``: torch's weight-only int8 kernel on bf16 inputs (fast where the CPU has bf16 dot products).
With x the normed hidden row, xb = bf16(x), w_j row j of the head, q_j its int8 copy and s_j its bf16 scale, the kernel returns a_j = bf16(sum_i xb_i q_ij s_j),
accumulated in float32, and

    |x . w_j - a_j| <=  |x - xb|_1 max|w_j|                 (rounding x to bf16)
                      + |xb|_1 max|w_j - q_j s_j|           (quantising w_j)
                      + 2^-8 |xb|_1 max|w_j| (1 + 2^-7)     (a kernel that rounds q_j s_j to bf16 first)
                      + H 2^-22 (|x|_1 + |xb|_1) max|w_j|   (float32 sums: the kernel's, and the reference's own)
                      + 2^-8 |a_j|                          (the bf16 result)

``Int8InputScreen``: fbgemm's int8 x int8 products (for CPUs without bf16 dot products), with the input quantised too. A last
hidden state has a few loud dimensions (|x_i| up to ~47 where the median is ~0.9), and one scale for the whole
row would make every other dimension's step coarse; so the LOUD loudest dimensions of each row are taken apart,
through a copy of the head laid out by dimension (one 8-bit row per dimension, per-row scale and offset:
fbgemm's 8-bit embedding bags, 28 MB), and the rest r goes through the int8 product with one scale s for the
input rows (values 0..127 around a zero point: no pair of u8 x s8 products can saturate AVX2's 16-bit sums).
With x = r + l (l: the loud dimensions), q_j, s_j the int8 row and its float32 scale, e_i the embedding row's
largest error and m_i its largest term (the row's |scale| 255 + |offset|):

    |x . w_j - y_j| <=  s (1/2 + 2^-8) (|w_j|_1 + H max|w_j - q_j s_j|)  (quantising r: the kernel's rounding)
                      + |r|_1 max|w_j - q_j s_j|                       (quantising w_j)
                      + sum_l |x_i| (e_i + (LOUD + 8) 2^-23 m_i)        (the loud part's rows, and its sums)
                      + 2^-20 (|y_j| + sum_l |x_i| m_i)                 (the kernel's float32 rescaling, the add)
                      + H 2^-23 |x|_1 max|w_j|                          (the reference's own float32 sums)

(the kernel's sums of integers are exact, its float32 rescaling of them off by a few 2^-24 of |y_j|). On real last
hidden states of SmolLM2 this bound keeps fewer rows than the weight-only screen's (docs/benchmarks.md).

In both, a row j with a_j + bound_j below max_k (a_k - bound_k) is below that row k exactly, so it is not the
argmax. The kept rows get their exact logits; every other entry of the returned row is -inf (only its argmax
is meaningful, which is all a greedy pick reads).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from swarm.config import cache_dir
from swarm.models.backends.cpu import int4
from swarm.models.backends.cpu.kept import keep, machine, one_at_a_time, read_kept

logger = logging.getLogger(__name__)

ROWS_TIMED = (1, 2, 4, 8)  # calibration: screening is kept for row counts up to the last one clearly faster
CLEARLY_FASTER = 0.9  # the screen must take at most this share of the dense head's time
_REPEATS = 7
# past this share of the vocabulary kept, a row's float32 re-check would cost more than the dense head's row
MOST_KEPT = 1 / 32
LOUD = 32  # Int8InputScreen: each row's loudest dimensions, taken apart from its int8 product
_INPUT_STEPS = 125  # Int8InputScreen: the input's range spans this many steps (values 0..127 around the zero)
_engine_lock = threading.Lock()
PICKS_NAME = "argmax-screens.json"  # the screen picked per machine and head shape, in the cache directory
FINISH_SOURCE = Path(__file__).with_name("screen.c")  # Int8InputScreen's steps after its int8 product


class ArgmaxScreen:
    """A screen of an LM head weight [V, H] (float32, CPU): ``bounds`` gives screened logits and a bound on
    each one's error; ``logits`` turns them into the exact argmax."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.ndim != 2:
            raise ValueError(f"{type(self).__name__} takes a 2-D float32 CPU weight")
        if not self.available(weight.shape[1]) or not exact_available():
            raise ValueError(f"no {type(self).__name__} for rows of {weight.shape[1]} on this torch")
        self.weight = weight  # the exact rows the kept candidates are computed from
        self.row_max = weight.abs().amax(dim=1)  # [V]

    @staticmethod
    def available(hidden_size: int) -> bool:
        raise NotImplementedError

    def bounds(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """normed [N, H] -> (screened logits [N, V], a bound [N, V] on each one's distance from the exact one)."""
        raise NotImplementedError

    def logits(self, normed: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """normed [N, H] float32 -> [N, V]: the exact logits (``exact_logits``) at the rows that can be the
        argmax, -inf elsewhere; so each row's argmax is that of ``exact_logits`` over the whole vocabulary.

        A row whose screen keeps too many candidates (a flat distribution), or none (a bound that overflowed),
        gets every exact logit instead; a row that is not finite (the input's scale would be NaN) gets
        ``dense``'s logits."""
        finite = torch.isfinite(normed).all(dim=1)
        if not bool(finite.all()):
            out = torch.empty(normed.shape[0], self.weight.shape[0])
            out[~finite] = dense(normed[~finite])
            if bool(finite.any()):
                out[finite] = self.logits(normed[finite], dense)
            return out
        screened, kept = self.candidates(normed)
        out = torch.full_like(screened, float("-inf"))
        for r, rows in enumerate(kept):
            if rows is None:
                out[r] = exact_logits(normed[r], self.weight)
            else:  # each candidate's logit computed as the reference computes it, bit for bit
                out[r, rows] = exact_logits(normed[r], self.weight, rows)
        return out

    def candidates(self, normed: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """normed [N, H] -> (screened logits [N, V], per input row the vocabulary rows that can be its argmax,
        or None where they are too many or none)."""
        screened, bound = self.bounds(normed)
        floor = (screened - bound).amax(dim=1, keepdim=True)  # some row's exact logit is at least this
        keep = screened + bound >= floor  # [N, V]
        counts = keep.sum(dim=1)  # [N]
        flat = (counts > self.weight.shape[0] * MOST_KEPT) | (counts == 0)  # [N]
        keep[flat] = False
        counts[flat] = 0
        _, tokens = keep.nonzero(as_tuple=True)  # the kept vocabulary rows of every input row, in row order
        kept = tokens.split(counts.tolist())
        return screened, [
            None if is_flat else rows for rows, is_flat in zip(kept, flat.tolist(), strict=True)
        ]


class Int8WeightScreen(ArgmaxScreen):
    """int8 weights (per-row bf16 scales) times bf16 inputs, through torch's weight-only int8 kernel."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self._sum_rounding = weight.shape[1] * 2.0**-22
        self.scales = (self.row_max / 127).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        scales = self.scales.float()[:, None]
        self.quantised = torch.round(weight / scales).clamp(-127, 127).to(torch.int8)  # [V, H]
        self.quantisation_error = (weight - self.quantised.float() * scales).abs().amax(dim=1)  # [V]

    @staticmethod
    def available(hidden_size: int) -> bool:
        """Whether this torch has the weight-only int8 kernel, for rows of ``hidden_size``: its CPU kernel reads
        the rows in blocks of 16 (32 for AVX2) without checking the end (torch 2.13: garbage or a crash for 40)."""
        return hasattr(torch, "_weight_int8pack_mm") and hidden_size % 32 == 0

    def bounds(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class Int8InputScreen(ArgmaxScreen):
    """int8 weights times int8 inputs (fbgemm), each row's LOUD loudest dimensions apart (module docstring). The
    steps after fbgemm's product (the loud dimensions' rows, the bounds, their lowest top, the rows kept) run in
    one C pass per input row (screen.c) where this machine builds it, else in torch."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        vocab, hidden = weight.shape
        self.loud = min(LOUD, hidden)
        scales = (self.row_max / 127).clamp_min(torch.finfo(torch.float32).tiny)  # float32: the kernel's own
        # in place where it can be: each pass over a [V, H] float32 copy is 113 MB for the default model
        ints = (weight / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # [V, H]
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's kernels are not
            warnings.simplefilter("ignore")
            quantised = torch._make_per_channel_quantized_tensor(
                ints, scales.double(), torch.zeros(vocab, dtype=torch.long), 0
            )
        with _fbgemm_engine():
            self.packed = torch.ops.quantized.linear_prepack(quantised, None)
        # float32 sums and differences, each bound widened by its own rounding (a float64 copy would be 226 MB)
        error = ints.float().mul_(scales[:, None]).sub_(weight).abs_().amax(dim=1) + self.row_max * 2.0**-22
        absolute_sum = weight.abs().sum(dim=1) * (1 + hidden * 2.0**-23)  # [V]
        # per vocabulary row: the terms of the bound that scale with the input's step, with |r|_1 and with |x|_1
        self.per_row = _rounded_up(
            torch.stack(
                (absolute_sum.double() + hidden * error.double(), error.double(), self.row_max.double())
            )
        )  # [3, V]
        by_dimension = weight.t().contiguous()  # [H, V]
        self.by_dimension = torch.ops.quantized.embedding_bag_byte_prepack(by_dimension)  # [H, V+8]
        scale_offset = self.by_dimension[:, vocab:].contiguous().view(torch.float32)  # [H, 2]
        largest_term = scale_offset[:, 0].abs() * 255 + scale_offset[:, 1].abs()  # [H]
        rows = (
            self.by_dimension[:, :vocab].float().mul_(scale_offset[:, :1]).add_(scale_offset[:, 1:])
        )  # [H, V]
        dimension_error = rows.sub_(by_dimension).abs_().amax(dim=1) + largest_term * 2.0**-21  # [H]
        self.loud_error = _rounded_up(
            dimension_error.double() + (self.loud + 8) * 2.0**-23 * largest_term.double()
        )
        self.loud_term = _rounded_up(largest_term.double() * (1 + 2.0**-20))  # [H]
        self.dimension_scale = scale_offset[:, 0].contiguous()  # [H]
        self.dimension_offset = scale_offset[:, 1].contiguous()  # [H]
        self.finish = _finish()  # screen.c's, or None: the same steps in torch

    @staticmethod
    def available(hidden_size: int) -> bool:
        return "fbgemm" in torch.backends.quantized.supported_engines and hidden_size > 0

    def bounds(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.finish is not None:
            screened, bound, _, _ = self._finished(normed, 0)
            return screened, bound
        loud, loud_values, screened, coefficients, constant = self._screen(normed)
        offsets = torch.arange(0, normed.shape[0] * self.loud, self.loud)
        screened += torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
            self.by_dimension, loud.flatten(), offsets, False, 0, False, loud_values.flatten(), None, False
        )
        bound = torch.addmm(constant, coefficients, self.per_row)
        bound.add_(screened.abs(), alpha=2.0**-20)
        return screened, bound

    def candidates(self, normed: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        if self.finish is None:
            return super().candidates(normed)
        cap = int(self.weight.shape[0] * MOST_KEPT)
        screened, _, kept, counts = self._finished(normed, cap)
        return screened, [kept[r, :n] if 0 < n <= cap else None for r, n in enumerate(counts.tolist())]

    def _screen(
        self, normed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int8 product of the rows without their loud dimensions, and what the bound needs: (loud [N, LOUD],
        their values [N, LOUD], screened [N, V] without them, coefficients [N, 3] of self.per_row and the
        constant term [N, 1], both widened)."""
        count, hidden = normed.shape
        loud = normed.abs().topk(self.loud, dim=1).indices  # [N, LOUD]
        loud_values = normed.gather(1, loud)  # [N, LOUD]
        rest = normed.scatter(1, loud, 0.0)  # [N, H]
        low, high = min(float(rest.min()), 0.0), max(float(rest.max()), 0.0)
        step = max((high - low) / _INPUT_STEPS, torch.finfo(torch.float32).tiny * 2**30)
        zero = round(-low / step)  # rest / step + zero lies in [0, 126]: u8 values of 7 bits
        screened = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rest, step, zero, self.packed
        )  # [N, V]
        loud_abs = loud_values.abs()
        coefficients = torch.cat(  # [N, 3]: times self.per_row
            (
                torch.full((count, 1), step * (0.5 + 2.0**-8)),
                rest.abs().sum(dim=1, keepdim=True),
                normed.abs().sum(dim=1, keepdim=True) * (hidden * 2.0**-23),
            ),
            dim=1,
        )
        constant = (loud_abs * self.loud_error[loud]).sum(dim=1, keepdim=True) + 2.0**-20 * (
            loud_abs * self.loud_term[loud]
        ).sum(dim=1, keepdim=True)  # [N, 1]
        # every term is >= 0, so terms widened by 2^-10 outweigh the float32 rounding of their sums here
        widen = 1 + 2.0**-10
        return loud, loud_values, screened, coefficients * widen, constant * widen

    def _finished(
        self, normed: torch.Tensor, cap: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """screen.c's finish: (screened [N, V], bound [N, V], kept [N, cap], counts [N]), as ``bounds`` and
        ``candidates`` in torch compute them (see screen.c)."""
        assert self.finish is not None
        loud, loud_values, screened, coefficients, constant = self._screen(normed)
        screened = screened.contiguous()
        count, vocab = screened.shape
        bound = torch.empty_like(screened)
        kept = torch.empty((count, cap), dtype=torch.int64)
        counts = torch.empty(count, dtype=torch.int64)
        self.finish(
            *(screened.data_ptr(), count, vocab, self.by_dimension.data_ptr(), self.by_dimension.shape[1]),
            *(self.dimension_scale.data_ptr(), self.dimension_offset.data_ptr()),
            *(loud.contiguous().data_ptr(), loud_values.contiguous().data_ptr(), self.loud),
            *(
                self.per_row.data_ptr(),
                coefficients.contiguous().data_ptr(),
                constant.contiguous().data_ptr(),
            ),
            *(bound.data_ptr(), cap, kept.data_ptr(), counts.data_ptr()),
        )
        return screened, bound, kept, counts


@functools.cache
def _library() -> ctypes.CDLL | None:
    """screen.c's library, or None where this machine cannot build it (x86-64 with AVX2 and a C compiler)."""
    if int4.unsupported():
        return None
    try:
        return int4.load(FINISH_SOURCE)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        logger.info("no screens of the LM head here: %s", e)
        return None


@functools.cache
def _finish() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """screen.c's ``screen_finish``, or None where the library does not build."""
    library = _library()
    if library is None:
        return None
    address, count = ctypes.c_void_p, ctypes.c_long
    function = library.screen_finish
    function.argtypes = [
        *(address, count, count, address, count),  # screened, rows, vocabulary, by dimension, its row stride
        *(address, address, address, address, count),  # scales, offsets, loud dimensions and values, LOUD
        *(address, address, address),  # per_row, coefficients, constant
        *(address, count, address, address),  # bound, cap, kept, counts
    ]
    function.restype = None
    return function


@functools.cache
def _dot_rows() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    library = _library()
    if library is None:
        return None
    address, count = ctypes.c_void_p, ctypes.c_long
    function = library.dot_rows
    function.argtypes = [address, count, address, address, count, address]  # x, K, W, rows, count, out
    function.restype = None
    return function


def exact_available() -> bool:
    """Whether ``exact_logits`` runs here (screen.c builds)."""
    return _dot_rows() is not None


def exact_logits(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """What a greedy step's argmax is exact against: x [H] . weight[j] for each vocabulary row j in ``rows``
    (every row where None), each the float32 sum of float32 products in one fixed order (screen.c's dot_rows).

    A logit is the same bits whichever other rows are computed with it and on every x86 CPU, so a screen's
    re-check of its candidates gives exactly the logits of the whole row: the argmax a screened greedy step
    returns is, by construction, the argmax of ``exact_logits(x, weight)``. It differs from F.linear's logits
    only by the order of the sums (float rounding), as F.linear's own kernels differ between CPUs."""
    function = _dot_rows()
    if function is None:
        raise RuntimeError("the exact logits need screen.c, which does not build here")
    if x.ndim != 1 or weight.ndim != 2 or x.shape[0] != weight.shape[1]:
        raise ValueError(f"x [H] and weight [V, H] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError("exact_logits takes float32 x and a contiguous float32 weight")
    x = x.contiguous()
    picked = None if rows is None else rows.to(torch.int64).contiguous()
    if (
        picked is not None
        and picked.numel()
        and (int(picked.min()) < 0 or int(picked.max()) >= weight.shape[0])
    ):
        raise ValueError("rows outside the weight")
    count = weight.shape[0] if picked is None else picked.numel()
    out = torch.empty(count, dtype=torch.float32)
    function(
        x.data_ptr(),
        x.shape[0],
        weight.data_ptr(),
        None if picked is None else picked.data_ptr(),
        count,
        out.data_ptr(),
    )
    return out


SCREENS: tuple[type[ArgmaxScreen], ...] = (Int8WeightScreen, Int8InputScreen)


def calibrated_screen(
    dense: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
    sample: torch.Tensor,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[ArgmaxScreen | None, int]:
    """The screen worth taking for the LM head ``weight`` on this machine, and the rows up to which it screens:
    as an earlier process on this machine picked it (PICKS_NAME in the cache directory), else timed on
    ``sample`` (``pick_screen``) and kept. Building every kind and timing them takes seconds, which 16 client
    processes starting at once on two cores paid in turn."""
    kinds = {kind.__name__: kind for kind in SCREENS if kind.available(weight.shape[1])}
    if not kinds or not exact_available():
        return None, 0
    key = json.dumps([machine(), torch.get_num_threads(), *weight.shape])
    kept = _kept_pick(key, kinds, weight)
    if kept is not None:
        return kept
    with one_at_a_time(_picks_path()):
        kept = _kept_pick(key, kinds, weight)  # picked by the process we waited for, or not
        if kept is not None:
            return kept
        screen, rows = pick_screen(dense, [kind(weight) for kind in kinds.values()], sample, clock)
        keep(_picks_path(), key, {"screen": type(screen).__name__ if screen else "", "rows": rows})
    return screen, rows


def _kept_pick(
    key: str, kinds: dict[str, type[ArgmaxScreen]], weight: torch.Tensor
) -> tuple[ArgmaxScreen | None, int] | None:
    """The screen kept under ``key`` (built on ``weight``) and its rows, or None if none valid is kept."""
    entry = read_kept(_picks_path(), key)
    if isinstance(entry, dict) and _valid_pick(entry.get("screen"), entry.get("rows"), kinds):
        name, rows = entry["screen"], entry["rows"]
        return (kinds[name](weight), rows) if name else (None, 0)
    return None


def _valid_pick(name: object, rows: object, kinds: dict[str, type[ArgmaxScreen]]) -> bool:
    """A kept pick this torch can take: a kind it runs with rows timed, or none (a damaged file is timed again)."""
    if name == "":
        return rows == 0
    return name in kinds and isinstance(rows, int) and rows in ROWS_TIMED


def _picks_path() -> Path:
    return cache_dir() / PICKS_NAME


def pick_screen(
    dense: Callable[[torch.Tensor], torch.Tensor],
    screens: list[ArgmaxScreen],
    sample: torch.Tensor,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[ArgmaxScreen | None, int]:
    """The screen that saves the most time over ``dense`` on ``sample`` [max(ROWS_TIMED), H] (normed rows like
    the model's last hidden states, whose logits have a clear top: random rows have flat logits, which keep
    thousands of candidates), and the most rows (of ROWS_TIMED) up to which it is clearly faster than ``dense``
    at every row count timed; (None, 0) if none is clearly faster even for one row."""
    best: tuple[ArgmaxScreen | None, int, float] = (None, 0, 0.0)
    for candidate in screens:
        timed = _timings(dense, candidate, sample, clock)
        saved = sum(dense_s - screen_s for _, dense_s, screen_s in timed)
        if timed and saved > best[2]:
            best = (candidate, timed[-1][0], saved)
    picked, rows, _ = best
    if picked is not None:
        logger.info(
            "greedy steps of up to %d rows take the LM head's argmax through an int8 screen (%s)",
            rows,
            type(picked).__name__,
        )
    return picked, rows


def _timings(
    dense: Callable[[torch.Tensor], torch.Tensor],
    screen: ArgmaxScreen,
    sample: torch.Tensor,
    clock: Callable[[], float],
) -> list[tuple[int, float, float]]:
    """[(rows, dense seconds, screen seconds)] for the row counts of ROWS_TIMED up to the first at which the
    screen is not clearly faster."""
    timed = []
    for rows in ROWS_TIMED:
        x = sample[:rows]
        dense_s = _best_time(functools.partial(dense, x), clock)
        screen_s = _best_time(functools.partial(screen.logits, x, dense), clock)
        logger.debug(
            "LM head, %d rows: dense %.2f ms, %s %.2f ms",
            rows,
            dense_s * 1e3,
            type(screen).__name__,
            screen_s * 1e3,
        )
        if screen_s > CLEARLY_FASTER * dense_s:
            break
        timed.append((rows, dense_s, screen_s))
    return timed


def _best_time(run: Callable[[], object], clock: Callable[[], float]) -> float:
    run()  # warm up (kernel selection, page faults on the copy)
    best = float("inf")
    for _ in range(_REPEATS):
        started = clock()
        run()
        best = min(best, clock() - started)
    return best


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 no smaller than each value (a bound must not shrink in the conversion)."""
    single = values.float()
    return torch.where(single.double() < values, torch.nextafter(single, torch.tensor(float("inf"))), single)


@contextlib.contextmanager
def _fbgemm_engine() -> Iterator[None]:
    """torch picks the packing of a quantized weight by a process-wide setting: fbgemm's, for this one call."""
    with _engine_lock:
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            yield
        finally:
            torch.backends.quantized.engine = engine
