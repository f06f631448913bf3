"""Tensors on the wire: raw little-endian bytes with dtype and shape (never pickle), and hidden states in a codec."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from swarm.codec import CODECS, bytes_per_token, dequantize_q8, pack_q8, to_f16, unpack_q8
from swarm.errors import (
    ProtocolError,
)
from swarm.types import DTYPE_BYTES
from swarm.wire.fields import _map, _str
from swarm.wire.limits import (
    _DTYPE_NAMES,
    MAX_HIDDEN_SIZE,
    MAX_TENSOR_BYTES,
    MAX_TOKENS,
    WIRE_DTYPES,
)


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """(dtype, shape, raw bytes); the tensor is moved to CPU and made contiguous, its dtype is kept.

    ``data`` is a view of the tensor's memory (no copy; msgpack copies it once, into the message), so the
    tensor must not change before the message is packed.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ProtocolError(f"cannot send a {tensor.dtype} tensor: wire dtypes are {sorted(WIRE_DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().data
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def decode_tensor(obj: object, what: str = "tensor") -> torch.Tensor:
    body = _map(obj, what)
    name = _str(body, "dtype", what)
    dtype = WIRE_DTYPES.get(name)
    if dtype is None:
        raise ProtocolError(f"{what}: unsupported dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
    shape = body.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
        raise ProtocolError(f"{what}: shape must be a list of 1 to 4 dimensions, got {shape!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_TOKENS * 16 for d in shape):
        raise ProtocolError(f"{what}: every dimension must be a positive int, got shape {shape}")
    data = body.get("data")
    if not isinstance(data, bytes | memoryview):  # memoryview: an encode_tensor result decoded unsent
        raise ProtocolError(f"{what}: data must be bytes")
    expected = math.prod(shape) * DTYPE_BYTES[name]
    if expected > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{what}: {expected} bytes is over the {MAX_TENSOR_BYTES}-byte tensor limit")
    if len(data) != expected:
        raise ProtocolError(f"{what}: shape {shape} of {name} needs {expected} bytes, got {len(data)}")
    # One copy, on purpose: msgpack hands us immutable bytes, and the tensor must own writable memory (torch
    # warns on, and in-place ops would write into, a view of bytes).
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    return flat.reshape(shape)


def encode_hidden(hidden: torch.Tensor, codec: str = "exact") -> dict[str, Any]:
    """Hidden states [T, H] in ``codec`` (swarm.codec): exact as encode_tensor; f16 as a 16-bit tensor with
    ``codec``; q8 as int8 ``data`` [T, H] with, per block of Q8_BLOCK values, float32 ``scales`` and
    ``peaks`` and uint8 ``peak_index`` [T, ceil(H / Q8_BLOCK)], and the ``dtype`` to decode them to. Without
    a ``codec`` key a tensor is exact, so exact states keep their old bytes."""
    if codec == "exact":
        return encode_tensor(hidden)
    if codec == "f16":
        return encode_tensor(to_f16(hidden)) | {"codec": "f16"}
    if codec != "q8":
        raise ValueError(f"unknown activation codec {codec!r}; expected one of {CODECS}")
    if hidden.dim() != 2:
        raise ProtocolError(f"q8 sends hidden states [tokens, hidden_size], got shape {list(hidden.shape)}")
    name = _DTYPE_NAMES.get(hidden.dtype)
    if name is None:
        raise ProtocolError(f"cannot send a {hidden.dtype} tensor: wire dtypes are {sorted(WIRE_DTYPES)}")
    return {"codec": "q8", "dtype": name, "shape": list(hidden.shape)} | pack_q8(hidden)


def decode_hidden(obj: object, what: str = "hidden") -> tuple[torch.Tensor, str]:
    """(hidden states, the codec they came in), from encode_hidden's map; ProtocolError for anything else."""
    body = _map(obj, what)
    codec = body.get("codec", "exact")
    if codec == "q8":
        return _decode_q8(body, what), codec
    if "codec" in body and codec != "f16":
        raise ProtocolError(f"{what}: unknown codec {codec!r}; expected one of {CODECS[1:]} or none")
    hidden = decode_tensor(body, what)
    if codec == "f16" and hidden.dtype not in (torch.float16, torch.bfloat16):
        raise ProtocolError(f"{what}: f16 states must be float16 or bfloat16, got {hidden.dtype}")
    return hidden, codec


def _decode_q8(body: dict[str, Any], what: str) -> torch.Tensor:
    name = _str(body, "dtype", what)
    dtype = WIRE_DTYPES.get(name)
    if dtype is None:
        raise ProtocolError(f"{what}: unsupported dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
    shape = body.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int for d in shape)):
        raise ProtocolError(f"{what}: q8 shape must be [tokens, hidden_size], got {shape!r}")
    tokens, size = shape
    if not (0 < tokens <= MAX_TOKENS and 0 < size <= MAX_HIDDEN_SIZE):
        raise ProtocolError(f"{what}: q8 shape {shape} is past the limits [{MAX_TOKENS}, {MAX_HIDDEN_SIZE}]")
    if tokens * bytes_per_token("q8", dtype, size) > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{what}: q8 shape {shape} is over the {MAX_TENSOR_BYTES}-byte tensor limit")
    if tokens * size * 4 > MAX_TENSOR_BYTES:  # decoding works in float32: bound what it unpacks to as well
        raise ProtocolError(f"{what}: q8 shape {shape} unpacks past the {MAX_TENSOR_BYTES}-byte tensor limit")
    return dequantize_q8(unpack_q8(body, tokens, size, what), dtype)


def _hidden(body: dict[str, Any]) -> tuple[torch.Tensor, str]:
    hidden, codec = decode_hidden(body.get("hidden"), "hidden")
    if hidden.dim() != 2:
        raise ProtocolError(f"hidden must be [tokens, hidden_size], got shape {list(hidden.shape)}")
    tokens, size = hidden.shape
    if tokens > MAX_TOKENS or size > MAX_HIDDEN_SIZE:
        raise ProtocolError(
            f"hidden shape {list(hidden.shape)} is past the limits [{MAX_TOKENS}, {MAX_HIDDEN_SIZE}]"
        )
    if not _all_finite(hidden):
        raise ProtocolError("hidden contains NaN or infinity")
    return hidden, codec


def _codec(body: dict[str, Any], what: str) -> str:
    codec = body.get("codec", "exact")
    if codec not in CODECS:
        raise ProtocolError(f"{what}.codec must be one of {CODECS}, got {codec!r}")
    return str(codec)


def _all_finite(tensor: torch.Tensor) -> bool:
    # numpy's isfinite on a CPU view costs a fraction of torch's op dispatch for the small tensors of decode
    # steps; bfloat16, which numpy lacks, goes by amax/amin (they propagate NaN and see infinities).
    if tensor.dtype in (torch.float32, torch.float16):
        return bool(np.isfinite(tensor.numpy()).all())
    return bool(torch.isfinite(tensor.amax()) and torch.isfinite(tensor.amin()))
