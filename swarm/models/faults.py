"""TEST ONLY: a lying peer. ``OutputFaults`` adds noise to a fraction of the hidden states a peer returns.

Spot-checks (client.spot) must catch a peer that computes its layers wrongly; the integration tests and the
benchmark start one with ``swarm-peer join --faulty-output-rate P``. The draws come from a private RNG seeded
from the peer's name, so a test run is repeatable and two faulty peers do not lie in lockstep.
"""

from __future__ import annotations

import random
import zlib

import torch


def seed_of(name: str) -> int:
    """A stable seed from a peer's name (Python's hash() of a str changes between processes)."""
    return zlib.crc32(name.encode())


class OutputFaults:
    """With probability ``rate`` per call, returns ``hidden`` plus Gaussian noise as large as its own RMS."""

    def __init__(self, rate: float, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"faulty output rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._draws = random.Random(seed)
        self._noise = torch.Generator().manual_seed(seed)
        self.corrupted = 0  # how many outputs were corrupted so far

    def corrupt(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._draws.random() >= self.rate:
            return hidden
        self.corrupted += 1
        # noise as large as the signal: far past any rounding tolerance, so a check can never miss it
        scale = hidden.float().pow(2).mean().sqrt().clamp_min(1.0)
        noise = torch.randn(hidden.shape, generator=self._noise) * scale
        return (hidden.float() + noise.to(hidden.device)).to(hidden.dtype)
