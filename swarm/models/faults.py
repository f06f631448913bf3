"""TEST ONLY: a lying peer. ``OutputFaults`` adds noise to a fraction of the hidden states a peer returns, and
skips forwarding a fraction of the steps it should pass down its route.

Spot-checks (client.spot) must catch a peer that computes its layers wrongly (``swarm-peer join
--faulty-output-rate P``) and one that, asked to forward, returns its own output instead and fakes the timings
of the hops it skipped (``--faulty-skip-rate P``): honest when called alone, so only a check of the route as
forwarded can catch it. The draws come from private RNGs seeded from the peer's name, so a test run is
repeatable and two faulty peers do not lie in lockstep.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import torch

from swarm.wire import Hop, HopTiming


def seed_of(name: str) -> int:
    """A stable seed from a peer's name (Python's hash() of a str changes between processes)."""
    return zlib.crc32(name.encode())


class OutputFaults:
    """With probability ``rate`` per call, returns ``hidden`` plus Gaussian noise as large as its own RMS."""

    def __init__(self, rate: float, seed: int, skip_rate: float = 0.0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"faulty output rate must be in [0, 1], got {rate}")
        if not 0.0 <= skip_rate <= 1.0:
            raise ValueError(f"faulty skip rate must be in [0, 1], got {skip_rate}")
        self.rate = rate
        self.skip_rate = skip_rate
        self._draws = random.Random(seed)
        self._skip_draws = random.Random(seed + 1)  # its own stream: the corruption pattern stays as it was
        self._noise = torch.Generator().manual_seed(seed)
        self.corrupted = 0  # how many outputs were corrupted so far
        self.skipped = 0  # how many forwards were skipped so far

    def skip_forward(self) -> bool:
        """Whether to skip the hops after us on this step (drawn only for steps that have hops to skip)."""
        if self.skip_rate == 0 or self._skip_draws.random() >= self.skip_rate:
            return False
        self.skipped += 1
        return True

    @staticmethod
    def fake_timings(skipped: Sequence[Hop]) -> tuple[HopTiming, ...]:
        """Plausible timings for hops that never ran, so the reply looks like the whole route answered."""
        return tuple(HopTiming(hop.peer_id, hop.start, hop.end, 1e-4, 1e-3, 2e-3) for hop in skipped)

    def corrupt(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._draws.random() >= self.rate:
            return hidden
        self.corrupted += 1
        # noise as large as the signal: far past any rounding tolerance, so a check can never miss it
        scale = hidden.float().pow(2).mean().sqrt().clamp_min(1.0)
        noise = torch.randn(hidden.shape, generator=self._noise) * scale
        return (hidden.float() + noise.to(hidden.device)).to(hidden.dtype)
