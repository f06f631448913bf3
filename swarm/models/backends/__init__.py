"""Device backends: the one seam between shared model code and a device's kernels (see base.py).

    backend = for_device(torch.device("cpu"), torch.float32)   # CpuBackend: 4-bit kernels, matmul forms, screens
    backend = for_device(torch.device("cuda:0"), torch.bfloat16)  # CudaBackend
    backend = for_device(torch.device("cpu"), torch.bfloat16)   # TorchBackend: plain torch ops
    backend = for_device(torch.device("cuda:0"), torch.float16, "nf4")  # QuantBackend: bitsandbytes' modules

Only swarm/models/backends/cpu/ imports the CPU kernels; a GPU peer never loads them.
"""

from __future__ import annotations

import torch

from swarm.models.backends.base import Backend, Batch, HeadKernels, RangeKernels, Shape, held_bytes
from swarm.models.backends.generic import TorchBackend


def for_device(device: torch.device, dtype: torch.dtype, quant: str = "none") -> Backend:
    """The backend for weights of ``dtype`` on ``device``: bitsandbytes' modules for a ``quant`` other than
    none (on any device), the CPU's own kernels for float32 on a CPU, the CUDA backend on a GPU, plain torch
    otherwise."""
    if quant != "none":
        from swarm.models.backends.quant import QuantBackend

        return QuantBackend(quant, device, dtype)
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
