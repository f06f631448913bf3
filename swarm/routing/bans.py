"""Temporary bans of peers that failed, with exponential backoff and an injected clock.

A peer that fails is skipped for `base_s`; each further failure before it succeeds again doubles the ban (by
`factor`) up to `max_s`. A success forgets its failures, and so does a long quiet spell (`forget_after_s`
after the ban ended), so a peer that had one bad hour is not punished forever.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarm.types import NodeID


@dataclass(frozen=True)
class BanConfig:
    """How long failing peers are skipped."""

    base_s: float = 1.0  # first ban, seconds
    factor: float = 2.0  # each consecutive failure multiplies the ban by this
    max_s: float = 60.0  # longest ban, seconds
    forget_after_s: float = 300.0  # failures are forgotten this long after the last ban ended, seconds

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.max_s < self.base_s:
            raise ValueError(f"need 0 < base_s <= max_s, got base_s={self.base_s}, max_s={self.max_s}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")


@dataclass
class _Ban:
    failures: int
    until_s: float


class BanList:
    """Which peers to skip now. `clock` returns seconds (time.monotonic live, simulated time in the simulator)."""

    def __init__(self, clock: Callable[[], float], config: BanConfig | None = None) -> None:
        self._clock = clock
        self.config = config or BanConfig()
        self._bans: dict[NodeID, _Ban] = {}

    def ban(self, peer: NodeID) -> float:
        """Record a failure of `peer`; returns how many seconds it is banned for."""
        now = self._clock()
        old = self._bans.get(peer)
        failures = 1
        if old is not None and now < old.until_s + self.config.forget_after_s:
            failures = old.failures + 1
        duration_s = min(self.config.base_s * self.config.factor ** (failures - 1), self.config.max_s)
        self._bans[peer] = _Ban(failures, now + duration_s)
        return duration_s

    def succeeded(self, peer: NodeID) -> None:
        """The peer served a request: forget its past failures."""
        self._bans.pop(peer, None)

    def is_banned(self, peer: NodeID) -> bool:
        ban = self._bans.get(peer)
        return ban is not None and self._clock() < ban.until_s

    def failures(self, peer: NodeID) -> int:
        """Consecutive failures still remembered for `peer`."""
        ban = self._bans.get(peer)
        if ban is None or self._clock() >= ban.until_s + self.config.forget_after_s:
            return 0
        return ban.failures
