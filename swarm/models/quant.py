"""A peer's layers with their projections quantized through bitsandbytes (``swarm-peer join --quant``).

    quantize_linears(layer, "nf4", device, dtype)   # every nn.Linear of a loaded decoder layer, in place
    reference_config("nf4", dtype)                  # the transformers BitsAndBytesConfig that loads the same

The modules are bitsandbytes' own (Linear4bit, Linear8bitLt), built as transformers builds them for a
``BitsAndBytesConfig``, so a range quantized here computes what transformers computes for the model loaded with
``reference_config``: greedy tokens equal. Embeddings, norms and the client's LM head stay as loaded.

int8 is LLM.int8(): input columns with any value past the threshold run in 16 bits, so a row's result depends on
the other rows of its call (a batch of sessions); nf4 rows are computed independently of each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarm.types import QUANT_KINDS

INT8_THRESHOLD = 6.0  # LLM.int8()'s outlier threshold, transformers' default (llm_int8_threshold)
NF4_DOUBLE_QUANT = True  # block scales quantized too: ~4.13 bits a weight instead of 4.5


def bitsandbytes(kind: str) -> Any:
    """The bitsandbytes module for quant ``kind``; ValueError in one line where it cannot be imported (or the
    kind is unknown). Called at start, so a peer that cannot quantize fails before it joins."""
    if kind not in QUANT_KINDS or kind == "none":
        raise ValueError(
            f"unknown quant {kind!r}: use one of {', '.join(k for k in QUANT_KINDS if k != 'none')}"
        )
    try:
        import bitsandbytes as bnb
    except Exception as e:  # not installed, or its native library does not load on this machine
        reason = (str(e).splitlines() or [""])[0]
        raise ValueError(
            f"--quant {kind} needs bitsandbytes, which cannot be imported here ({type(e).__name__}: {reason}): "
            "pip install bitsandbytes==0.50.2 (./scripts/setup installs it), or join without --quant"
        ) from e
    return bnb


def check_runs(kind: str, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError in one line unless bitsandbytes imports and quantizes and runs a small layer on ``device`` in
    ``dtype``: what a peer checks before it joins, so a library without kernels for this device fails then."""
    bitsandbytes(kind)
    try:
        layer = quantize_linears(
            nn.Sequential(nn.Linear(64, 64, device=device, dtype=dtype)), kind, device, dtype
        )
        layer(torch.zeros(1, 64, device=device, dtype=dtype))
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"--quant {kind} cannot run on {device} ({dtype}) here: bitsandbytes failed with "
            f"{type(e).__name__}: {reason}; join without --quant, or on a device bitsandbytes supports"
        ) from e


def quantize_linears(layer: nn.Module, kind: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``layer`` (loaded in ``dtype`` on ``device``) with every nn.Linear replaced by its bitsandbytes form,
    quantized on ``device``; layers already quantized are left as they are."""
    bnb = bitsandbytes(kind)
    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    for name, child in list(layer.named_modules()):
        if isinstance(child, nn.Linear) and not isinstance(child, quantized):
            parent_name, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent_name), attr, _quantized(bnb, child, kind, device, dtype))
    return layer


def _quantized(bnb: Any, linear: nn.Linear, kind: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``linear`` as transformers' bitsandbytes integration makes it: the module, then its weight quantized
    by moving a bitsandbytes parameter to ``device``."""
    weight, bias = linear.weight.data, linear.bias
    args = (linear.in_features, linear.out_features, bias is not None)
    module: Any
    if kind == "nf4":
        module = bnb.nn.Linear4bit(
            *args,
            compute_dtype=dtype,
            compress_statistics=NF4_DOUBLE_QUANT,
            quant_type="nf4",
            quant_storage=torch.uint8,
            device="meta",
        )
        module.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            compress_statistics=NF4_DOUBLE_QUANT,
            quant_type="nf4",
            quant_storage=torch.uint8,
            module=module,
        ).to(device)
    else:
        module = bnb.nn.Linear8bitLt(*args, has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
        # Int8Params quantizes when moved from the CPU (as transformers loads it)
        module.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(
            device
        )
    if bias is not None:
        module.bias = nn.Parameter(bias.data.to(device, dtype), requires_grad=False)
    return module.eval()


def stats_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the quantization statistics these modules keep beside their weights (nf4's block scales and
    their own scales, int8's row scales): tensors held by no parameter or buffer."""
    seen: dict[int, int] = {}
    for module in modules:
        for sub in module.modules():
            weight = getattr(sub, "weight", None)
            state = getattr(weight, "quant_state", None)
            tensors = _state_tensors(state) if state is not None else []
            tensors += [
                t for t in (getattr(weight, "SCB", None), getattr(getattr(sub, "state", None), "SCB", None))
            ]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_tensors(state: Any) -> list[Any]:
    """A bitsandbytes QuantState's tensors, its nested state's (double quantization) included."""
    tensors = [state.absmax, state.code, getattr(state, "offset", None)]
    nested = getattr(state, "state2", None)
    return tensors + (_state_tensors(nested) if nested is not None else [])


def reference_config(kind: str, dtype: torch.dtype) -> Any:
    """The transformers ``BitsAndBytesConfig`` that loads a checkpoint as ``quantize_linears`` quantizes it."""
    from transformers import BitsAndBytesConfig

    bitsandbytes(kind)
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=NF4_DOUBLE_QUANT,
        bnb_4bit_quant_storage=torch.uint8,
    )


__all__ = [
    "INT8_THRESHOLD",
    "bitsandbytes",
    "check_runs",
    "quantize_linears",
    "reference_config",
    "stats_bytes",
]
