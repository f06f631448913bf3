"""Activation codecs: the form a hop's hidden states take on the wire, and which form a hop uses.

    exact   the model's dtype, bit for bit (the default: greedy tokens equal local transformers)
    f16     16 bits a value for a 32-bit model: float16, or bfloat16 for a tensor float16 cannot hold (outliers
            past 65504 would become infinities); a 16-bit model's states are already 16-bit and go exact
    q8      8 bits a value: int8 with one float32 scale per block of Q8_BLOCK values along the hidden dim
            (absmax scaling), each block's largest value kept aside in float32; decoded back to the dtype it
            was sent from

The receiving peer converts what arrives to its compute dtype before running its layers, so its KV cache and
outputs stay in the model's dtype; only the states crossing the hop lose precision. ``auto`` picks a lighter
codec for a hop whose link is slow next to the hop's compute (``choose_codec``). swarm.wire lays the forms out
on the wire (``encode_hidden``, ``decode_hidden``), q8's parts packed and checked here (``pack_q8``,
``unpack_q8``). scripts/bench_activations.py measures their error on real hidden states (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm.errors import ProtocolError
from swarm.settings import positive, setting

CODECS = ("exact", "f16", "q8")
MODES = ("exact", "auto", "f16", "q8")  # a setting: a codec, or auto (chosen per hop by its link)
Q8_BLOCK = 32  # values sharing one scale; hidden sizes are multiples of it (SmolLM2's 576: 18 blocks)
Q8_LEVELS = 127  # int8 values are in [-127, 127]: symmetric, so 0 stays exact
_F16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class ActivationConfig:
    """Hidden states on the wire (swarm/codec.py)"""

    mode: str = setting(
        "exact",
        "how hidden states travel to the next hop: exact (the model's dtype; tokens equal to local "
        "transformers), f16 (16 bits a value), q8 (8 bits, a scale per block), auto (lighter where the "
        "link is slow)",
        flag="--activations",
        choices=MODES,
    )
    # A decode step's token crosses a hop in microseconds on any link; a long prompt's states take
    # tokens x hidden_size x 4 bytes, which over a slow uplink can cost more than computing them.
    auto_fraction: float = setting(
        0.25,
        "auto: a hop goes lighter where sending a token's hidden state takes longer than this fraction of "
        "computing it through the hop's layers",
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activations mode must be one of {MODES}, got {self.mode!r}")
        positive(self, "auto_fraction")


def bytes_per_token(codec: str, dtype: torch.dtype, hidden_size: int) -> int:
    """What one token's hidden state weighs on the wire in ``codec``, sent from a model in ``dtype``."""
    if codec == "q8":
        return hidden_size + 9 * q8_blocks(hidden_size)  # a value a byte; a block's scale, peak and its index
    if codec == "f16":
        return 2 * hidden_size
    return dtype.itemsize * hidden_size


def choose_codec(
    mode: str,
    dtype: torch.dtype,
    hidden_size: int,
    bandwidth_bytes_s: float | None = None,
    compute_s_per_token: float | None = None,
    auto_fraction: float = ActivationConfig.auto_fraction,
) -> str:
    """The codec of one hop. ``auto``: the heaviest form whose transfer of a token takes at most
    ``auto_fraction`` of the hop's compute per token, else q8; exact while the link or the compute is unknown.
    f16 of a 16-bit model is exact (it saves nothing)."""
    sixteen = dtype.itemsize <= 2
    if mode != "auto":
        return "exact" if mode == "f16" and sixteen else mode
    if not bandwidth_bytes_s or not compute_s_per_token:
        return "exact"
    budget_s = auto_fraction * compute_s_per_token
    for codec in ("exact", "q8") if sixteen else ("exact", "f16"):
        if bytes_per_token(codec, dtype, hidden_size) / bandwidth_bytes_s <= budget_s:
            return codec
    return "q8"


def to_f16(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` in float16, or in bfloat16 if any value is past float16's range (it would become inf)."""
    if hidden.dtype in (torch.float16, torch.bfloat16):
        return hidden
    if hidden.numel() and float(hidden.detach().abs().amax()) > _F16_MAX:
        return hidden.to(torch.bfloat16)
    return hidden.to(torch.float16)


def q8_blocks(hidden_size: int) -> int:
    return math.ceil(hidden_size / Q8_BLOCK)


@dataclass(frozen=True)
class Quantized:
    """Hidden states [T, H] in q8: B = ceil(H / Q8_BLOCK) blocks a token, each its int8 values, its scale
    (the absmax of the rest / 127) and its largest value (its peak) kept aside at full precision."""

    values: torch.Tensor  # int8 [T, H]; 0 where a block's peak sits
    scales: torch.Tensor  # float32 [T, B]
    peaks: torch.Tensor  # float32 [T, B]: each block's value of largest magnitude
    peak_index: torch.Tensor  # uint8 [T, B]: where it sits in its block


def quantize_q8(hidden: torch.Tensor) -> Quantized:
    """Each block of Q8_BLOCK values along H loses its peak (kept aside), and the rest are divided by their
    absmax / 127 and rounded. Real hidden states have a few channels hundreds of times larger than the others
    (SmolLM2's reach 25,000 where most are under 10): scaled by one of them, the rest of its block would round
    to zero (docs/benchmarks.md has what that does to greedy tokens)."""
    tokens, size = hidden.shape
    blocks = q8_blocks(size)
    padded = torch.zeros(tokens, blocks * Q8_BLOCK, dtype=torch.float32)
    padded[:, :size] = hidden.detach().to("cpu", torch.float32)
    grouped = padded.view(tokens, blocks, Q8_BLOCK)  # [T, B, Q8_BLOCK]
    magnitude = grouped.abs()
    magnitude.view(tokens, -1)[:, size:] = -1.0  # padding is never a block's peak
    index = magnitude.argmax(dim=-1, keepdim=True)  # [T, B, 1]
    peaks = grouped.gather(-1, index)
    rest = grouped.scatter(-1, index, 0.0)
    scales = rest.abs().amax(dim=-1) / Q8_LEVELS  # [T, B]
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    values = (rest / divisor[..., None]).round().clamp(-Q8_LEVELS, Q8_LEVELS).to(torch.int8)
    return Quantized(
        values.view(tokens, -1)[:, :size].contiguous(),
        scales,
        peaks[..., 0].contiguous(),
        index[..., 0].to(torch.uint8),
    )


def dequantize_q8(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_q8, in ``dtype``. The peak indexes must be within their blocks (the wire checks)."""
    tokens, size = q.values.shape
    blocks = q.scales.shape[1]
    padded = torch.zeros(tokens, blocks * Q8_BLOCK, dtype=torch.float32)
    padded[:, :size] = q.values.to(torch.float32)
    grouped = padded.view(tokens, blocks, Q8_BLOCK) * q.scales.to(torch.float32)[..., None]
    grouped.scatter_(-1, q.peak_index.long()[..., None], q.peaks.to(torch.float32)[..., None])
    return grouped.view(tokens, -1)[:, :size].to(dtype)


def pack_q8(hidden: torch.Tensor) -> dict[str, memoryview]:
    """hidden [T, H] quantized, as the q8 fields of a wire tensor (swarm.wire): each part's raw bytes."""
    q = quantize_q8(hidden)
    parts = {"data": q.values, "scales": q.scales, "peaks": q.peaks, "peak_index": q.peak_index}
    # flat, so len() counts bytes; a view of the tensor's memory, copied once by msgpack
    return {key: part.contiguous().reshape(-1).view(torch.uint8).numpy().data for key, part in parts.items()}


_Q8_PARTS = {"data": torch.int8, "scales": torch.float32, "peaks": torch.float32, "peak_index": torch.uint8}


def unpack_q8(fields: Mapping[str, object], tokens: int, size: int, what: str = "hidden") -> Quantized:
    """pack_q8's parts of a [tokens, size] tensor, every length, scale, peak and index checked:
    ProtocolError for anything that is not what pack_q8 makes."""
    blocks = q8_blocks(size)
    parts = {}
    for key, dtype in _Q8_PARTS.items():
        width = size if key == "data" else blocks
        raw = fields.get(key)
        if not isinstance(raw, bytes | memoryview):
            raise ProtocolError(f"{what}: q8 {key} must be bytes")
        if len(raw) != tokens * width * dtype.itemsize:
            raise ProtocolError(
                f"{what}: q8 shape [{tokens}, {size}] needs {tokens * width} values of {key} ({dtype}), got "
                f"{len(raw)} bytes"
            )
        parts[key] = torch.frombuffer(bytearray(raw), dtype=dtype).view(tokens, width)
    q = Quantized(parts["data"], parts["scales"], parts["peaks"], parts["peak_index"])
    if not bool(torch.isfinite(q.scales).all()) or bool((q.scales < 0).any()):
        raise ProtocolError(f"{what}: q8 scales must be finite and non-negative")
    if not bool(torch.isfinite(q.peaks).all()):
        raise ProtocolError(f"{what}: q8 peaks must be finite")
    last = size - (blocks - 1) * Q8_BLOCK  # values in the last block
    if bool((q.peak_index >= Q8_BLOCK).any()) or int(q.peak_index[:, -1].max()) >= last:
        raise ProtocolError(f"{what}: a q8 peak_index is past its block")
    return q


def round_trip(hidden: torch.Tensor, codec: str) -> torch.Tensor:
    """What the receiver of ``hidden`` sent in ``codec`` computes with, back in ``hidden``'s dtype (the
    benchmark applies codecs this way, without a wire)."""
    if codec == "f16":
        return to_f16(hidden).to(hidden.dtype)
    if codec == "q8":
        quantized = quantize_q8(hidden.reshape(-1, hidden.shape[-1]))
        return dequantize_q8(quantized, hidden.dtype).reshape(hidden.shape).to(hidden.device)
    return hidden


def relative_errors(sent: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Per token (row): ||received - sent|| / ||sent||, in float32."""
    a, b = sent.float().reshape(-1, sent.shape[-1]), received.float().reshape(-1, sent.shape[-1])
    return (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)
