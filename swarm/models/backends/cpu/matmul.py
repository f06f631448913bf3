"""``linear``: ``F.linear``, or the form of the same product this CPU runs faster for the input's row count.

Decoding is bound by reading the weights once per step, so a projection of 1 to 16 rows should cost about one
pass over them. Whether ``F.linear`` gets there depends on the CPU and its BLAS (the same product is faster one
way on an AMD EPYC and the other way on an Intel Xeon), so it is measured, not assumed (``calibrate``, once per
process and set of weight shapes, and kept per machine in the cache directory). The forms:

- few columns: ``weight @ x.T``, MKL's kernel for a few columns (one row goes through it as two);
- a packed copy beside the float32 weight, laid out for the kernel that reads it (``pack``): oneDNN's or MKL's.
  It doubles the weights' memory, so its owner decides whether it can afford it (BlockRange's ``pack_bytes``);
  calibration then times it for 1 to 16 rows and for 64 and says for which row counts it pays (speeds jump about
  between row counts);
- 4-bit: weights that are exactly 4-bit (a GGUF Q4_1 checkpoint such as the default model's) held as nibbles
  with a scale and minimum per block of 32 (int4.py, held.py), in place of the float32 weight. ``calibrate_held``
  keeps the 4-bit kernel for every row count except where F.linear over the widened weight is clearly faster.

Only the summation order differs from ``F.linear`` in any form (each output is the same dot product), so outputs
agree with transformers' to float rounding and greedy tokens are those of transformers (the exactness tests).
GPUs and other dtypes never come here. Measurements: docs/benchmarks.md (``scripts/bench_matmul.py``).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from swarm.config import cache_dir
from swarm.models.backends.cpu import int4
from swarm.models.backends.cpu.held import Int4Linear
from swarm.models.backends.cpu.kept import keep, machine, one_at_a_time, read_kept

logger = logging.getLogger(__name__)

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

MAX_FEW_ROWS = 4  # past this many rows F.linear was never slower on the machines measured
PACKED_ROWS = 16  # packed weights are laid out for this many rows (a decode batch's default cap)
PACKED_TIMED_ROWS = range(1, PACKED_ROWS + 1)  # each timed: MKL's speed jumps about between row counts
LONG_ROWS = 64  # timed for inputs past PACKED_ROWS (prefill chunks)
CALIBRATION_BYTES = 96 * 2**20  # weights timed per form: more than a CPU's caches hold, as in a decode step
# calibrations kept in the cache directory, per machine, torch build and weight shapes
STORE_NAME = "matmul-forms.json"
# a form other than F.linear is kept only where it takes at most this share of the time of the one it replaces
CLEARLY_FASTER = 0.9
FOUR_BIT_ROWS_CHECKED = 64  # rows of a weight that must be exactly 4-bit for calibration to time that form


@dataclass(frozen=True)
class Forms:
    """The forms of a product worth taking on this CPU, by the rows of its input (see ``calibrate``)."""

    few_rows: int = 0  # 1 to few_rows rows: the few-columns form (0: never)
    packer: str = ""  # the packed copy to keep ("onednn" or "mkl", see ``pack``; "": none)
    # these row counts (1 to PACKED_ROWS) go through the packed copy, and with packed_beyond longer inputs too
    packed_rows: frozenset[int] = frozenset()
    packed_beyond: bool = False

    def packs(self, rows: int) -> bool:
        """Whether an input of ``rows`` rows goes through the packed copy (when its owner keeps one)."""
        return bool(self.packer) and (rows in self.packed_rows or (rows > PACKED_ROWS and self.packed_beyond))

    def form(self, rows: int) -> str:
        """The form ``linear`` takes for a CPU float32 input of ``rows`` rows: the packer's name, "few_rows"
        (the few-columns form) or "plain" (F.linear)."""
        if self.packs(rows):
            return self.packer
        return "few_rows" if 0 < rows <= self.few_rows else "plain"


PLAIN = Forms()  # F.linear for every input


def _has_onednn() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def _has_mkl() -> bool:
    try:
        return torch.backends.mkl.is_available() and callable(torch.ops.mkl._mkl_linear)
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def packers() -> tuple[str, ...]:
    """The packed-weight kernels this machine has: oneDNN's (x86 and Arm builds of torch), MKL's (x86 builds),
    and the 4-bit one (swarm.models.backends.cpu.int4, for weights that are exactly 4-bit; x86 with AVX2 and a C compiler)."""
    return tuple(
        name for name, has in (("onednn", _has_onednn), ("mkl", _has_mkl), ("int4", int4.available)) if has()
    )


class NotFourBit(ValueError):
    """A weight asked to be packed as 4-bit is not exactly 4-bit (swarm.models.backends.cpu.int4)."""


def packing_available() -> bool:
    return bool(packers())


def pack(weight: torch.Tensor, packer: str) -> torch.Tensor:
    """``packer``'s packed copy of a CPU float32 weight [N, K], for ``linear(..., packed=)``: as large as the
    weight, or 3/16 of it for "int4" (NotFourBit if the weight is not exactly 4-bit)."""
    if packer == "int4":
        packed = int4.unpack(weight.detach())
        if packed is None:
            raise NotFourBit(f"a weight of shape {tuple(weight.shape)} is not exactly 4-bit in blocks of 32")
        return packed
    if packer == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)
    if packer == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACKED_ROWS)
    raise ValueError(f"unknown packer {packer!r}")


def taken(forms: Forms, weights: Sequence[torch.Tensor]) -> tuple[Forms, dict[int, torch.Tensor]]:
    """``forms`` if ``weights`` can take them (CPU float32; else PLAIN), and the packed copies they use, by
    ``id(weight)``: what a weights' owner keeps."""
    if any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return PLAIN, {}
    try:
        return forms, {id(w): pack(w, forms.packer) for w in weights} if forms.packer else {}
    except NotFourBit as e:  # calibrated on weights of these shapes that were 4-bit; these are not all
        logger.info("not taking the 4-bit form: %s", e)
        return Forms(forms.few_rows), {}


def few_rows_kernel(x: torch.Tensor, weight: torch.Tensor, few_rows: int) -> bool:
    """Whether ``linear`` computes ``x @ weight.T`` as ``weight @ x.T``: CPU float32, 1 to few_rows rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        0 < rows <= few_rows
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def _keep_torch_threads() -> None:
    """Apply torch's thread count to the calling thread, before a kernel torch does not set it for.

    OpenMP keeps a thread count per OS thread, and a thread that never set one runs parallel regions on every
    core. torch's own ops apply torch's count in each thread first; the oneDNN and MKL kernels called below do
    not, so in a worker thread (a peer's executor, a client's head batcher) they ran on 2 cores each, their
    second thread spinning between calls (a client process spent 2x the CPU per token). torch.get_num_threads
    applies the count the first time it runs in a thread (18 ns): torch's lazy per-thread initialisation, not a
    documented promise, so test_matmul checks it in a fresh process."""
    torch.get_num_threads()


def _few_columns(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] @ weight.T as weight @ rows.T: [M, N]."""
    _keep_torch_threads()
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat((rows, rows))  # one column would take the slow kernel (see the module doc)
    return (weight @ rows.T).T[:count]  # rows.T is a view: the layout this kernel is fast with


def _packed_product(
    rows: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packer: str
) -> torch.Tensor:
    """rows [M, K] @ weight.T (+ bias) through ``packed`` (``pack(weight, packer)``): [M, N]."""
    if packer == "int4":
        out = int4.product(rows, packed, weight.shape[0])
        return out if bias is None else out + bias
    _keep_torch_threads()
    rows = rows.contiguous()  # the packed kernels take rows laid out one after another
    if packer == "onednn":
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    forms: Forms = PLAIN,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] and weight [N, K]: [..., N], in the form ``forms`` gives for
    x's rows (``packed``: ``pack(weight, forms.packer)``, if the caller keeps one)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if packed is not None and forms.packs(rows) and x.dtype == torch.float32 and x.device.type == "cpu":
        out = _packed_product(x.reshape(rows, x.shape[-1]), packed, weight, bias, forms.packer)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if not few_rows_kernel(x, weight, forms.few_rows):
        return F.linear(x, weight, bias)
    out = _few_columns(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def project(
    x: torch.Tensor, layer: torch.nn.Linear, forms: Forms = PLAIN, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer(x)`` for a transformers ``nn.Linear`` projection, through ``linear``."""
    return linear(x, layer.weight, layer.bias, forms, packed)


def packed_rows(seconds_by_rows: dict[int, tuple[float, float]]) -> frozenset[int]:
    """From {rows: (seconds of the form taken otherwise, packed seconds)}: the row counts at which the packed
    weights took at most CLEARLY_FASTER of the other form's time."""
    return frozenset(
        rows for rows, (other, packed) in seconds_by_rows.items() if packed <= CLEARLY_FASTER * other
    )


def _saved(seconds_by_rows: dict[int, tuple[float, float]], rows: frozenset[int]) -> float:
    return sum(seconds_by_rows[r][0] - seconds_by_rows[r][1] for r in rows)


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


_calibrated_by_key: dict[tuple[object, ...], Forms] = {}
_calibration_lock = threading.Lock()


def calibrate(
    weights: Sequence[torch.Tensor],
    *,
    packing: bool = False,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> Forms:
    """The forms worth taking for products with these float32 weights on this CPU; packed copies are timed only
    if ``packing`` (the caller could afford a copy beside the weights), with each packer this torch has.

    Times one pass over a sample of the weights (each shape once, then more up to CALIBRATION_BYTES) per form and
    row count, best of ``repeats``. The answer is a fact of the machine and the weight shapes, so it is kept per
    process and set of shapes (every layer of a model has the same set, so a peer that re-loads other layers of
    its model or a test that makes many ranges pays for it once), and in the cache directory (STORE_NAME) per
    CPU, torch build, set of shapes and build of the 4-bit kernel. Delete that file to measure again."""
    weights = [w.detach() for w in weights]
    if not weights or any(w.device.type != "cpu" or w.dtype != torch.float32 or w.ndim != 2 for w in weights):
        return PLAIN
    offered = _offered(weights) if packing else ()
    shapes = sorted({tuple(w.shape) for w in weights})
    return _calibrated(shapes, offered, lambda: _sample(weights), repeats, clock)


def calibrate_held(
    linears: Sequence[Int4Linear], *, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> Forms:
    """The forms for weights held as 4-bit (swarm.models.backends.cpu.held): the 4-bit kernel for every row
    count, except those at which F.linear over the widened weights was clearly faster (each call then widens
    its weights into a scratch buffer first). Timed on widened copies of the first weights, as ``calibrate``."""
    if not linears or not int4.available():
        return PLAIN
    shapes = sorted({(m.out_features, m.in_features) for m in linears})

    def sample() -> list[torch.Tensor]:
        widened, size = [], 0
        for linear in linears:
            if size >= CALIBRATION_BYTES:
                break
            widened.append(linear.widened())
            size += widened[-1].numel() * 4
        return _sample(widened)

    return _calibrated(shapes, (HELD,), sample, repeats, clock)


HELD = "int4 held"  # calibration of weights held as 4-bit (calibrate_held), named apart from a copy's


def _calibrated(
    shapes: Sequence[tuple[int, ...]],
    offered: tuple[str, ...],
    sample: Callable[[], list[torch.Tensor]],
    repeats: int,
    clock: Callable[[], float],
) -> Forms:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    # a faster or slower build of the 4-bit kernel may change what is fastest: measure it again
    kernels = (f"int4 {int4.kernel_version()}",) if {"int4", HELD} & set(offered) else ()
    key = (torch.get_num_threads(), offered, *shapes, *kernels)
    known = _calibrated_by_key.get(key)
    if known is not None:
        return known
    with _calibration_lock:  # two loaders at once would time each other's memory traffic
        if key not in _calibrated_by_key:
            stored_key = json.dumps([machine(), *key])
            forms, how = _stored(stored_key), "kept from an earlier run on this machine"
            if forms is None:
                with one_at_a_time(_store_path()):
                    forms = _stored(stored_key)  # measured by the process we waited for, or not
                    if forms is None:
                        forms, how = _measure(sample(), offered, repeats, clock), "measured on this CPU"
                        _store(stored_key, forms)
            _calibrated_by_key[key] = forms
            logger.info(
                "matmul forms %s: few-columns for %s, packed weights %s",
                how,
                f"up to {forms.few_rows} rows" if forms.few_rows else "no row count",
                _packed_text(forms, bool(offered)),
            )
        return _calibrated_by_key[key]


def _offered(weights: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """The packers that can pack these weights: every one this machine has, the 4-bit one only if the weights
    are 4-bit (judged by the first rows of one weight of each shape; ``taken`` checks every weight)."""
    one_of_each = {tuple(w.shape): w for w in weights}.values()
    four_bit = all(int4.unpack(w[:FOUR_BIT_ROWS_CHECKED]) is not None for w in one_of_each)
    return tuple(p for p in packers() if p != "int4" or four_bit)


def _measure(
    sample: list[torch.Tensor], offered: Sequence[str], repeats: int, clock: Callable[[], float]
) -> Forms:
    """The forms calibration keeps, timed on ``sample`` (packed copies with each packer ``offered``; for HELD,
    the 4-bit kernel at every row count where F.linear over the widened weights is not clearly faster)."""
    if offered == (HELD,):
        seconds = _time_packed(sample, "int4", repeats, clock)
        kept = frozenset(r for r, (plain, four) in seconds.items() if not plain <= CLEARLY_FASTER * four)
        return Forms(0, "int4", kept - {LONG_ROWS}, LONG_ROWS in kept)
    few_seconds = _time_forms(sample, range(1, MAX_FEW_ROWS + 1), _few_columns, repeats, clock)
    few = few_rows_limit(few_seconds)
    forms, most_saved = Forms(few), 0.0
    for packer in offered:  # the one that saves the most, if any saves at all
        seconds = _time_packed(sample, packer, repeats, clock)
        for count in range(1, few + 1):  # these would otherwise take the few-columns form
            seconds[count] = (few_seconds[count][1], seconds[count][1])
        chosen = packed_rows(seconds)
        saved = _saved(seconds, chosen)
        if chosen and saved > most_saved:
            forms = Forms(few, packer, chosen - {LONG_ROWS}, LONG_ROWS in chosen)
            most_saved = saved
    return forms


def _store_path() -> Path:
    return cache_dir() / STORE_NAME


def _stored(key: str) -> Forms | None:
    """The forms kept on disk under ``key``, or None (none kept, or the entry is malformed)."""
    entry = read_kept(_store_path(), key)
    try:
        return None if entry is None else _forms_from(entry)
    except (ValueError, AttributeError, TypeError, KeyError) as e:
        logger.info("ignoring the kept matmul forms: %s", e)
        return None


def _forms_from(entry: Any) -> Forms:
    """Forms from a kept entry, checked: a damaged file must not pick a kernel this torch lacks."""
    few, packer, rows, beyond = (entry[k] for k in ("few_rows", "packer", "packed_rows", "packed_beyond"))
    if not (
        isinstance(few, int)
        and 0 <= few <= MAX_FEW_ROWS
        and packer in ("", *packers())
        and isinstance(beyond, bool)
        and all(isinstance(r, int) and r in PACKED_TIMED_ROWS for r in rows)
    ):
        raise ValueError(f"a kept form cannot be taken here: {entry}")
    return Forms(few, packer, frozenset(rows), beyond)


def _store(key: str, forms: Forms) -> None:
    """Keep ``forms`` on disk under ``key`` beside the others."""
    entry = {
        "few_rows": forms.few_rows,
        "packer": forms.packer,
        "packed_rows": sorted(forms.packed_rows),
        "packed_beyond": forms.packed_beyond,
    }
    keep(_store_path(), key, entry)


def _time_packed(
    sample: list[torch.Tensor], packer: str, repeats: int, clock: Callable[[], float]
) -> dict[int, tuple[float, float]]:
    """{rows: (F.linear seconds, packed seconds)} for 1 to PACKED_ROWS rows and LONG_ROWS."""
    packed = {id(w): pack(w, packer) for w in sample}

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _packed_product(x, packed[id(w)], w, None, packer)

    return _time_forms(sample, [*PACKED_TIMED_ROWS, LONG_ROWS], product, repeats, clock)


def _packed_text(forms: Forms, timed: bool) -> str:
    if not forms.packer:
        return "never" if timed else "not timed"
    beyond = f", and past {PACKED_ROWS}" if forms.packed_beyond else ""
    rows = _spans(forms.packed_rows) or "none"
    return f"({forms.packer}) for {rows} rows{beyond}"


def _spans(rows: frozenset[int]) -> str:
    """{4, 5, 6, 9} -> "4-6, 9"."""
    spans: list[list[int]] = []
    for row in sorted(rows):
        if spans and row == spans[-1][1] + 1:
            spans[-1][1] = row
        else:
            spans.append([row, row])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def _sample(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """One weight of each shape, then the rest in order, until CALIBRATION_BYTES; each cut to that many bytes
    (its first rows: still a contiguous matrix of the same row length)."""
    by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for weight in weights:
        by_shape.setdefault(tuple(weight.shape), weight)
    first_of_shape = list(by_shape.values())
    picked: list[torch.Tensor] = []
    seen: set[int] = set()
    size = 0
    for weight in [*first_of_shape, *weights]:
        if size >= CALIBRATION_BYTES and len(picked) >= len(first_of_shape):
            break
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        row_bytes = weight.shape[1] * weight.element_size()
        rows = max(1, min(weight.shape[0], CALIBRATION_BYTES // max(1, row_bytes)))
        picked.append(weight[:rows])
        size += rows * row_bytes
    return picked


def _time_forms(
    weights: list[torch.Tensor],
    row_counts: Iterable[int],
    form: Product,
    repeats: int,
    clock: Callable[[], float],
) -> dict[int, tuple[float, float]]:
    """{rows: (F.linear seconds, ``form`` seconds)}, each the best of ``repeats`` passes over ``weights``."""
    seconds: dict[int, tuple[float, float]] = {}
    with torch.no_grad():
        for rows in row_counts:
            # fixed values, not the global RNG: loading a model must not change what a seeded caller draws next
            inputs = {w.shape[1]: torch.full((rows, w.shape[1]), 0.5) for w in weights}
            forms: tuple[Product, Product] = (F.linear, form)
            best = [float("inf"), float("inf")]
            for attempt in range(repeats + 1):  # the first pass of each form warms up and is not counted
                for index, timed in enumerate(forms):  # interleaved: a slow spell of the machine hits both
                    began = clock()
                    for weight in weights:
                        timed(inputs[weight.shape[1]], weight)
                    elapsed = clock() - began
                    if attempt:
                        best[index] = min(best[index], elapsed)
            seconds[rows] = (best[0], best[1])
    return seconds
