"""The GPU backend: the home of CUDA work (CUDA graphs for decode calls, streams that overlap a prefill chunk
with decode steps, quantized weights held on the device).

Today it runs the generic torch path (F.linear, scaled_dot_product_attention) with the weights as loaded;
a faster form goes here, behind the same RangeKernels and HeadKernels, and nowhere else.
"""

from __future__ import annotations

from swarm.models.backends.generic import TorchBackend


class CudaBackend(TorchBackend):
    """CUDA devices, any dtype."""

    name = "cuda"


__all__ = ["CudaBackend"]
