"""Device backends: the one seam between shared model code and a device's kernels (see base.py).

    backend = for_device(torch.device("cpu"), torch.float32)   # CpuBackend: 4-bit kernels, matmul forms, screens
    backend = for_device(torch.device("cuda:0"), torch.bfloat16)  # CudaBackend
    backend = for_device(torch.device("cpu"), torch.bfloat16)   # TorchBackend: plain torch ops
    backend = for_device(torch.device("cuda:0"), torch.float16, quant="nf4")  # QuantBackend: bitsandbytes' modules
    backend = for_device(torch.device("cpu"), torch.float32, model_type="qwen3")  # TorchBackend running Qwen3Range

A family whose layer is not the Llama block (families.py) runs in plain torch ops on every device: the CPU's
4-bit and packed forms, which compute the Llama block, never see it.

Only swarm/models/backends/cpu/ imports the CPU kernels; a GPU peer never loads them.
"""

from __future__ import annotations

import torch

from swarm.models.backends.base import Backend, Batch, HeadKernels, RangeKernels, Shape, held_bytes
from swarm.models.backends.families import family_range
from swarm.models.backends.generic import TorchBackend


def for_device(
    device: torch.device, dtype: torch.dtype, quant: str = "none", model_type: str = "llama"
) -> Backend:
    """The backend for weights of ``dtype`` on ``device``: bitsandbytes' modules for a ``quant`` other than
    none (on any device; Llama-family layers only), the CPU's own kernels for float32 on a CPU, the CUDA backend
    on a GPU, plain torch otherwise; for a family with a layer of its own (``model_type``), that layer in plain
    torch, on the CUDA backend on a GPU."""
    own = family_range(model_type)
    if quant != "none":
        if own is not None:
            raise ValueError(
                f"--quant {quant} runs Llama-family layers only, not {model_type!r} (use --quant none)"
            )
        from swarm.models.backends.quant import QuantBackend

        return QuantBackend(quant, device, dtype)
    if own is not None:
        if device.type == "cuda":
            from swarm.models.backends.cuda import CudaBackend

            return CudaBackend(own)
        return TorchBackend(own)
    if device.type == "cpu" and dtype == torch.float32:
        from swarm.models.backends.cpu import CpuBackend

        return CpuBackend()
    if device.type == "cuda":
        from swarm.models.backends.cuda import CudaBackend

        return CudaBackend()
    return TorchBackend()


__all__ = [
    "Backend",
    "Batch",
    "HeadKernels",
    "RangeKernels",
    "Shape",
    "TorchBackend",
    "for_device",
    "held_bytes",
]
