"""Weights that are exactly 4-bit, multiplied without widening them in memory first.

GGUF checkpoints such as the default model's (Q4_1) keep every run of 32 weights of a row as 4-bit integers q
with a float16 scale d and minimum m, and transformers widens them to float32 as ``d * q + m``. A decode step
reads every weight once, so on a CPU it is bound by memory: packed, the weights take 3/16 of their float32 bytes.

`unpack` finds q, d and m in the float32 weights themselves, and keeps them only where ``d * q + m`` gives back
every weight bit for bit: the kernel then multiplies by exactly the weights transformers has, and only the
order of the sums differs from ``F.linear``. Weights that are not of this form (a float16 checkpoint, the tiny
random test models) are left alone. `widen` writes the float32 weights back, bit for bit.

The product is a small C kernel (int4.c), compiled with this machine's C compiler the first time it is needed
and kept in the cache directory (torch's own 4-bit CPU kernel was far slower than F.linear). The kernel needs
AVX2 and FMA; without them, or without a compiler, the form is not offered. Where torch finds AVX-512 it is
compiled with it too, and widens the weights of calls of few rows by a table a block (int4.c's table_rows).

`decode_layers` runs whole Llama-family layers for rows of a token each (decode steps, short prefills) in one
call of the same library (int4.c's ``decode_layer`` a layer): norms, the packed products, rotary angles, the
cache writes, attention and the gated MLP; written out in torch, a decode step's small operations cost more
than its products. Each operation rounds as torch's does except the sums of the norms and of attention, and exp
(int4.c's exp8, or libm's for the last few of a row): outputs agree to float rounding (relative 1e-6).
Measurements: docs/benchmarks.md (``scripts/bench_matmul.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import cache_dir
from swarm.models.kv_cache import Slot

logger = logging.getLogger(__name__)

BLOCK = 32  # weights of a row sharing one scale and minimum (GGUF's Q4_1 block)
MAX_HEAD_DIM = 512  # decode_layer's rotary scratch (int4.c's rope)
LEVELS = 15  # q runs 0 .. 15
SOURCE = Path(__file__).with_name("int4.c")
FLAGS = (
    "-O3",
    "-mavx2",
    "-mfma",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-lm",
)  # no fused d * q + m: int4.c
# int4.c's table_rows, where torch finds AVX-512 (not under ATEN_CPU_CAPABILITY=avx2)
AVX512_FLAGS = ("-mavx512f",)
COMPILE_TIMEOUT_S = 120.0


def row_bytes(in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` weights: the nibbles, then a float32 d and m per block."""
    return in_features // 2 + 2 * 4 * (in_features // BLOCK)


def unpack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed rows [N, row_bytes(K)] (uint8) of a CPU float32 weight [N, K] whose every block of 32 is
    exactly ``d * q + m`` (q in 0 .. 15, d a float16 value), or None if it is not."""
    if weight.ndim != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    rows, columns = weight.shape
    if rows == 0 or columns == 0 or columns % BLOCK:
        return None
    with torch.no_grad():
        blocks = weight.detach().reshape(rows, columns // BLOCK, BLOCK)
        least = blocks.amin(-1, keepdim=True)  # the block's q = 0
        # GGUF keeps d as float16: the largest weight's q = 15 gives it back to float32 rounding, well within
        # float16's; a weight not of the form fails the exact check below
        scale = ((blocks.amax(-1, keepdim=True) - least) / LEVELS).half().float()
        levels = torch.round((blocks - least) / torch.where(scale == 0, 1.0, scale)).clamp_(0, LEVELS)
        if not torch.equal(scale * levels + least, blocks):  # two roundings, as transformers widens them
            return None
        nibbles = levels.to(torch.uint8)
        nibbles = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
        return torch.cat(
            [
                nibbles.reshape(rows, columns // 2),
                scale.reshape(rows, -1).contiguous().view(torch.uint8),
                least.reshape(rows, -1).contiguous().view(torch.uint8),
            ],
            dim=1,
        )


def product(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """rows [M, K] (CPU float32) @ W.T for the weight W [out_features, K] that ``packed`` holds: [M, N]."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the 4-bit kernel is not available on this machine (see available())")
    if rows.ndim != 2 or rows.dtype != torch.float32 or rows.device.type != "cpu":
        raise ValueError(
            f"the 4-bit kernel takes CPU float32 rows [M, K], got {rows.dtype} {tuple(rows.shape)}"
        )
    count, columns = rows.shape
    if (
        columns % BLOCK
        or packed.dtype != torch.uint8
        or packed.device.type != "cpu"
        or tuple(packed.shape) != (out_features, row_bytes(columns))
    ):
        raise ValueError(
            f"packed weights of shape {tuple(packed.shape)} do not fit inputs of {columns} features and "
            f"{out_features} outputs"
        )
    rows = rows.contiguous()
    out = torch.empty(count, out_features, dtype=torch.float32)
    kernel(rows.data_ptr(), count, columns, packed.data_ptr(), out_features, out.data_ptr())
    return out


def widen(packed: torch.Tensor, out_features: int, in_features: int, out: torch.Tensor) -> None:
    """Write the float32 weight [out_features, in_features] that ``packed`` holds into ``out`` (contiguous,
    that many floats): each weight bit for bit the one ``unpack`` found."""
    function = _widen()
    if function is None:
        raise RuntimeError("the 4-bit kernel is not available on this machine (see available())")
    if (
        in_features % BLOCK
        or packed.dtype != torch.uint8
        or not packed.is_contiguous()
        or tuple(packed.shape) != (out_features, row_bytes(in_features))
        or out.dtype != torch.float32
        or not out.is_contiguous()
        or out.numel() != out_features * in_features
    ):
        raise ValueError(f"cannot widen packed weights {tuple(packed.shape)} into {tuple(out.shape)}")
    function(packed.data_ptr(), out_features, in_features, out.data_ptr())


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as ``decode_layers`` takes it: norm weights [hidden] and the packed projections (q, k, v
    packed together; gate and up packed together)."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps: float
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    intermediate: int


@dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int
    head_dim: int
    scale: float


def takes_head_dim(head_dim: int) -> bool:
    """Whether decode_layers computes heads of this size (even, for rotary halves; within its scratch)."""
    return head_dim % 2 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def _tensors(weights: LayerWeights) -> tuple[torch.Tensor, ...]:
    return (weights.norm_in, weights.norm_post, weights.qkv, weights.o, weights.gate_up, weights.down)


class LayerRun:
    """Consecutive layers as ``decode_layers`` takes them: the addresses of their weights, gathered once, after
    checking every weight's shape against the first layer's sizes (the kernel reads by those sizes)."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        if not layers:
            raise ValueError("a run of layers needs at least one layer")
        first = layers[0]
        self.hidden, self.intermediate = first.norm_in.numel(), first.intermediate
        self.qkv_rows, self.q_width = first.qkv.shape[0], first.o.shape[1] * 4 // 3  # row_bytes(K) = 3K/4
        for weights in layers:
            self._check(weights)
        self.layers = tuple(layers)  # kept: the addresses below point into their tensors
        # where the tensors' memory was: a tensor given other memory since (``.data =``, ``set_``) is not this run
        self._addresses = tuple(t.data_ptr() for w in layers for t in _tensors(w))
        count = len(layers)

        def addresses(tensors: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
            return (ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors))

        self.norm_in = addresses([w.norm_in for w in layers])
        self.norm_post = addresses([w.norm_post for w in layers])
        self.eps = (ctypes.c_float * count)(*(w.eps for w in layers))
        self.qkv = addresses([w.qkv for w in layers])
        self.o = addresses([w.o for w in layers])
        self.gate_up = addresses([w.gate_up for w in layers])
        self.down = addresses([w.down for w in layers])

    def _check(self, weights: LayerWeights) -> None:
        hidden, intermediate = self.hidden, self.intermediate
        if weights.intermediate != intermediate:
            raise ValueError(
                f"a layer's MLP is {weights.intermediate} wide, not {intermediate} as the run's first layer has it"
            )
        expected = {
            "norm_in": (weights.norm_in, torch.float32, (hidden,)),
            "norm_post": (weights.norm_post, torch.float32, (hidden,)),
            "qkv": (weights.qkv, torch.uint8, (self.qkv_rows, row_bytes(hidden))),
            "o": (weights.o, torch.uint8, (hidden, row_bytes(self.q_width))),
            "gate_up": (weights.gate_up, torch.uint8, (2 * intermediate, row_bytes(hidden))),
            "down": (weights.down, torch.uint8, (hidden, row_bytes(intermediate))),
        }
        for name, (tensor, dtype, shape) in expected.items():
            if (
                tensor.dtype != dtype
                or tuple(tensor.shape) != shape
                or not tensor.is_contiguous()
                or tensor.device.type != "cpu"
            ):
                raise ValueError(
                    f"a layer's {name} is {tensor.dtype} {tuple(tensor.shape)}, not a contiguous CPU {dtype} "
                    f"{shape} as the run's first layer has it"
                )

    def of(self, layers: Sequence[LayerWeights]) -> bool:
        """Whether this run was gathered from exactly these layer objects, their tensors where they were."""
        return (
            len(layers) == len(self.layers)
            and all(a is b for a, b in zip(layers, self.layers, strict=True))
            and tuple(t.data_ptr() for w in layers for t in _tensors(w)) == self._addresses
        )


def decode_layers(
    h: torch.Tensor,
    run: LayerRun,
    attention: Attention,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: Sequence[Sequence[Cache]],
) -> None:
    """int4.c's ``decode_layer`` through each layer of ``run`` in turn, in one call of the library: caches[i] are the
    rows' caches in the run's layer i (one call, not one per layer: each call costs interpreter work), each a
    pool of blocks with the session's table (kv_cache.Slot) or a contiguous (keys, values, length). If it fails
    (MemoryError), h holds the layers before the one that failed: the caller drops the step's cache writes
    (CpuRange._run_fused)."""
    function = _decode_layers()
    rows = h.shape[0]
    if function is None:
        raise RuntimeError("the 4-bit kernel is not available on this machine (see available())")
    if not takes_head_dim(attention.head_dim):
        raise ValueError(
            f"decode_layers takes an even head_dim up to {MAX_HEAD_DIM}, got {attention.head_dim}"
        )
    if (
        h.ndim != 2
        or h.dtype != torch.float32
        or not h.is_contiguous()
        or tuple(cos.shape) != (rows, attention.head_dim)
        or tuple(sin.shape) != (rows, attention.head_dim)
        or h.shape[1] != run.hidden
        or run.q_width != attention.heads * attention.head_dim
        or run.qkv_rows != (attention.heads + 2 * attention.kv_heads) * attention.head_dim
        or len(caches) != len(run.layers)
        or any(len(layer) != rows for layer in caches)
    ):
        raise ValueError(
            f"decode_layers takes rows [N, hidden] of the run's size with N caches a layer and angles, got "
            f"{tuple(h.shape)} for {run.hidden} features and {len(run.layers)} layers"
        )
    slots = _paged([slot for layer in caches for slot in layer], attention)
    cos, sin = cos.contiguous(), sin.contiguous()
    pointers = ctypes.c_void_p * len(slots)
    counts = ctypes.c_long * len(slots)
    failed = function(
        h.data_ptr(),
        rows,
        h.shape[1],
        len(run.layers),
        run.norm_in,
        run.norm_post,
        run.eps,
        run.qkv,
        run.o,
        run.gate_up,
        run.down,
        run.intermediate,
        attention.heads,
        attention.kv_heads,
        attention.head_dim,
        attention.scale,
        cos.data_ptr(),
        sin.data_ptr(),
        pointers(*(slot.keys.data_ptr() for slot in slots)),
        pointers(*(slot.values.data_ptr() for slot in slots)),
        pointers(*(slot.table.data_ptr() for slot in slots)),
        counts(*(slot.keys.shape[2] for slot in slots)),
        counts(*(slot.keys.shape[1] for slot in slots)),
        counts(*(slot.length for slot in slots)),
    )
    if failed:
        raise MemoryError("decode_layers could not allocate its scratch memory")


Cache = Slot | tuple[torch.Tensor, torch.Tensor, int]
_ONE_BLOCK = torch.zeros(1, dtype=torch.int64)  # the table of a contiguous cache: one block, the whole of it


def _paged(caches: Sequence[Cache], attention: Attention) -> list[Slot]:
    """``caches`` as pools of blocks with tables, checked against what the kernel reads and writes: a contiguous
    (keys, values, length) of [kv_heads, capacity, head_dim] is one block of ``capacity`` tokens. Each pool and
    table is checked once (a call's rows share them); the tables' entries are the pool's own (kv_cache), not
    checked one by one."""
    slots: list[Slot] = []
    pools: dict[int, int] = {}  # id of a pool -> its block size
    tables: dict[int, int] = {}  # id of a table -> its entries
    for cache in caches:
        if not isinstance(cache, Slot):
            keys, values, length = cache
            if keys.ndim != 3 or keys.shape != values.shape:
                raise ValueError(f"a cache of shape {tuple(keys.shape)} cannot take token {length}")
            cache = Slot(keys[:, None], values[:, None], _ONE_BLOCK, length)
        block_tokens = pools.get(id(cache.keys))
        if block_tokens is None:
            block_tokens = pools[id(cache.keys)] = _pool_block_tokens(cache, attention)
        entries = tables.get(id(cache.table))
        if entries is None:
            entries = tables[id(cache.table)] = _table_entries(cache.table, block_tokens)
        if not 0 <= cache.length < entries * block_tokens:
            raise ValueError(f"a cache of shape {tuple(cache.keys.shape)} cannot take token {cache.length}")
        slots.append(cache)
    return slots


def _pool_block_tokens(slot: Slot, attention: Attention) -> int:
    keys, values = slot.keys, slot.values
    kv_heads, _, block_tokens, head_dim = keys.shape if keys.ndim == 4 else (0, 0, 0, 0)
    if not (
        keys.shape == values.shape
        and (kv_heads, head_dim) == (attention.kv_heads, attention.head_dim)
        and keys.is_contiguous()
        and values.is_contiguous()
        and keys.dtype == values.dtype == torch.float32
    ):
        raise ValueError(f"a cache of shape {tuple(keys.shape)} cannot take token {slot.length}")
    return int(block_tokens)


def _table_entries(table: torch.Tensor, block_tokens: int) -> int:
    """The table's length, once it is known to be one the kernel reads (blocks of a multiple of 8 tokens,
    unless there is one block)."""
    if not (
        table.dtype == torch.int64
        and table.ndim == 1
        and table.is_contiguous()
        and table.device.type == "cpu"
        and (table.numel() == 1 or block_tokens % 8 == 0)
    ):
        raise ValueError(f"a block table of {table.dtype} {tuple(table.shape)} cannot be read")
    return table.numel()


def available() -> bool:
    """Whether this machine runs the kernel (compiled on the first call, then kept)."""
    return _kernel() is not None


@functools.cache
def _build() -> tuple[ctypes.CDLL, tuple[str, ...]] | None:
    """The kernel's library and the flags it was compiled with: flags(), or FLAGS where a compiler takes AVX2
    but not AVX-512 (None where neither builds)."""
    reason = unsupported()
    if reason:
        logger.info("4-bit weights are multiplied as float32 here: %s", reason)
        return None
    failure: Exception | None = None
    for chosen in dict.fromkeys((flags(), FLAGS)):
        try:
            return load(SOURCE, chosen), chosen
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            logger.info("the 4-bit kernel did not build with %s: %s", " ".join(chosen), e)
            failure = e
    logger.info("4-bit weights are multiplied as float32 here: no kernel (%s)", failure)
    return None


def _library() -> ctypes.CDLL | None:
    built = _build()
    return None if built is None else built[0]


def _function(name: str, argtypes: Sequence[type], restype: type | None) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled library's function ``name``, typed (None where the library is not available)."""
    library = _library()
    if library is None:
        return None
    function = getattr(library, name)
    function.argtypes, function.restype = list(argtypes), restype
    return function


_ADDRESS, _COUNT, _REAL = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("int4_matmul", [_ADDRESS, _COUNT, _COUNT, _ADDRESS, _COUNT, _ADDRESS], None)


@functools.cache
def _widen() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _function("int4_widen", [_ADDRESS, _COUNT, _COUNT, _ADDRESS], None)


@functools.cache
def _decode_layers() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    arguments = [
        *(_ADDRESS, _COUNT, _COUNT, _COUNT),  # h, rows, hidden, layers
        *(_ADDRESS,) * 3,  # per layer: norm weights in and after attention, eps
        *(_ADDRESS,) * 4,  # per layer: packed qkv, o, gate_up, down
        *(_COUNT, _COUNT, _COUNT, _COUNT, _REAL),  # intermediate size, heads, kv heads, head dim, scale
        *(_ADDRESS,) * 8,  # cos, sin; per layer and row: keys, values, tables, block and pool sizes, lengths
    ]
    return _function("decode_layers", arguments, ctypes.c_int)


def unsupported() -> str:
    """Why this machine cannot run kernels of this form: x86-64 C, AVX2 and FMA ("" if it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is written for x86-64, not {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # torch's AVX2 level includes FMA
        return f"the CPU lacks AVX2 and FMA (torch: {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C compiler (set CC, or install gcc)"
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def kernel_version() -> str:
    """What names this build of the kernel: a digest of its source, the compiler and the flags. Measurements
    that timed the kernel (swarm.models.backends.cpu.matmul's kept forms) hold for this version only."""
    built = _build()
    return _version(SOURCE, flags() if built is None else built[1])


_chosen_flags: list[tuple[str, ...]] = []  # built_with's, innermost last


def flags() -> tuple[str, ...]:
    """The compiler's flags here: FLAGS, and AVX512_FLAGS where torch runs its AVX-512 kernels (or, within
    built_with, the flags it was given)."""
    if _chosen_flags:
        return _chosen_flags[-1]
    return FLAGS + AVX512_FLAGS if torch.backends.cpu.get_cpu_capability() == "AVX512" else FLAGS


@contextlib.contextmanager
def built_with(chosen: tuple[str, ...]) -> Iterator[None]:
    """Within it, this module's kernels are the build of ``chosen`` flags instead of this machine's (compiled
    and kept as any build is): benchmarks and tests compare builds in one process. For one thread at a time:
    a product called from another thread meanwhile may take either build."""
    depth = len(_chosen_flags)
    _chosen_flags.append(chosen)
    _forget_build()
    try:
        yield
    finally:
        del _chosen_flags[depth]
        _forget_build()


def _forget_build() -> None:
    for cached in (_build, _kernel, _widen, _decode_layers):
        cached.cache_clear()


@functools.cache
def _version(source: Path, chosen: tuple[str, ...]) -> str:
    compiler = _compiler() or "cc"
    text = source.read_bytes()
    return hashlib.sha256(b"\0".join([text, compiler.encode(), *(f.encode() for f in chosen)])).hexdigest()[
        :16
    ]


def load(source: Path, chosen: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The shared library of the C ``source`` (next to this module), compiled with the ``chosen`` flags (FLAGS:
    AVX2 and FMA) on the first call on this machine and kept in the cache directory. Raises where it cannot be
    compiled or loaded."""
    return ctypes.CDLL(str(_compiled(source, chosen)))


def _compiled(source: Path, chosen: tuple[str, ...]) -> Path:
    """``source``'s shared library built with ``chosen``, compiled now if no earlier run here kept one."""
    compiler = _compiler() or "cc"
    target = cache_dir() / "kernels" / f"{source.stem}-{_version(source, chosen)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    # compiled beside the target and renamed into place: peers starting at once each get a whole library
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run(
            [compiler, *chosen, "-o", str(built), str(source)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)
    logger.info("compiled %s in %.1f s", source.name, time.perf_counter() - began)
    return target
