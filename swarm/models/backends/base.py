"""What a range of layers and the client's head need from a device: the seam between shared model code and
the kernels of one kind of device.

A ``Backend`` is chosen once per BlockRange and ClientHead from the device and dtype (``backends.for_device``).
It says how a loaded layer's weights are held on that device (``hold``: a CPU keeps exactly 4-bit weights as
4-bit, a GPU as loaded) and makes the two objects that run them:

- ``RangeKernels``: a batch of session steps through layers [start, end) (decode steps of one token and prefill
  chunks alike, each attending over its own session's cache), and a stateless step.
- ``HeadKernels``: the LM head's logits for a sampled step, and for a greedy step logits whose argmax is exact
  (entries that cannot be the argmax may be -inf).

BlockRange and ClientHead keep sessions, validation and batching; everything that depends on the form of the
weights or on a kernel lives behind these classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from swarm.models.kv_cache import SessionCache


@dataclass(frozen=True)
class Shape:
    """The attention shape of a range's layers."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # attention's softmax scale
    silu: bool  # the MLP's activation is SiLU (what fused kernels compute)


@dataclass(frozen=True)
class Batch:
    """Session steps over the same layers, their tokens one after another: what ``RangeKernels.run`` takes."""

    hidden: torch.Tensor  # [N, H], every step's tokens in order (the backend may change it in place)
    cos: torch.Tensor  # [N, head_dim] rotary angles of each token's position
    sin: torch.Tensor
    caches: list[SessionCache]  # one per step
    sizes: list[int]  # tokens of each step (sum N)
    positions: list[int]  # tokens each step's session had cached before it
    start: int
    end: int


class RangeKernels(ABC):
    """Runs a BlockRange's layers on its device (one executor thread owns it, like the BlockRange)."""

    windowed = False  # applies a sliding-window layer's window itself (else longer sessions are refused)

    def __init__(self, layers: Sequence[nn.Module], first_layer: int, shape: Shape) -> None:
        self.layers = list(layers)  # transformers *DecoderLayer modules, weights in the backend's held form
        self.first_layer = first_layer
        self.shape = shape

    @abstractmethod
    def run(self, batch: Batch, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """The batch through layers [batch.start, batch.end), writing each step's keys and values to its cache:
        [N, H]. ``between_layers`` is called before each layer after the first. A failed call leaves every
        cache as it was before the batch."""

    @abstractmethod
    def run_stateless(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """One step without a session: hidden [T, H] causal over its own tokens, nothing cached: [T, H]."""

    def same_form(self, rows: int, more_rows: int) -> bool:
        """Whether a forward call of ``rows`` rows keeps its form of products with ``more_rows`` more (the
        executor lets a short prefill ride along a decode call only then)."""
        return True

    def form(self, rows: int) -> str:
        """The name of the form a call of ``rows`` rows takes (for logs and tests)."""
        return "torch"


class HeadKernels(ABC):
    """The LM head on its device."""

    @abstractmethod
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [N, H] -> float32 logits [N, V]."""

    @abstractmethod
    def greedy_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [N, H] -> [N, V] float32 whose argmax per row is the greedy token (see the backend for what
        exact means there); entries that cannot be it may be -inf."""


class Backend(ABC):
    """One kind of device and dtype: how weights are held there and the kernels that run them."""

    name: str

    def hold(self, layer: nn.Module) -> nn.Module:
        """``layer`` (just loaded) with its weights in the form this device keeps them, in place."""
        return layer

    def held_bytes(self, modules: Sequence[nn.Module]) -> int:
        """Bytes the weights of these held modules take (what a memory budget counts)."""
        return held_bytes(modules)

    @abstractmethod
    def range_kernels(
        self, layers: Sequence[nn.Module], first_layer: int, shape: Shape, pack_bytes: int
    ) -> RangeKernels:
        """The kernels of a range of held layers; ``pack_bytes``: memory it may spend on copies of its
        weights beside them (0: none)."""

    @abstractmethod
    def head_kernels(self, weight: torch.Tensor, sample: Callable[[], torch.Tensor]) -> HeadKernels:
        """The kernels of an LM head ``weight`` [V, H]; ``sample()`` gives normed rows like a model's last
        hidden states, for a backend that times its forms."""


def held_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the tensors these modules hold, each storage once (views of one tensor count once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
