"""Naming a torch device, and saying plainly why a GPU asked for cannot be used (before a peer joins anything).

parse_device("cuda:0")   # torch.device("cuda:0"), or ValueError naming the fix
"""

from __future__ import annotations

import torch

SETUP_CUDA = "FLOWSWARM_TORCH=cuda ./scripts/setup"


def parse_device(device: str) -> torch.device:
    """``device`` ("cpu", "cuda" or "cuda:N") as a torch.device; ValueError, in one line that names the fix,
    when it is a GPU this process cannot use."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    index_text = device.partition(":")[2]
    if index_text and not index_text.isdigit():
        raise ValueError(f"bad device {device!r}: expected cuda:N with an integer N")
    why = cuda_unusable()
    if why:
        raise ValueError(f"device {device!r}: {why}")
    count = torch.cuda.device_count()
    if index_text and int(index_text) >= count:
        raise ValueError(f"device {device!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device(device)


def cuda_unusable() -> str:
    """Why this process cannot run on a GPU, with the fix; "" when it can."""
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU build; on a machine with an NVIDIA GPU and driver, "
            f"install the CUDA build: {SETUP_CUDA}"
        )
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: is the NVIDIA driver "
            "installed and loaded (nvidia-smi lists the GPU), and CUDA_VISIBLE_DEVICES not empty?"
        )
    return ""


__all__ = ["cuda_unusable", "parse_device"]
