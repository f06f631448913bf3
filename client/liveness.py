"""Noticing a dead peer while a step is outstanding, in about a second instead of at the step timeout.

A step goes to the route's first peer, which forwards it hop by hop; when a later hop dies (SIGKILL, power
loss), nobody may tell us: the hop before it can wait on a half-open connection as long as its own deadline.
So while a step is outstanding the client times it against what steps usually take, and once it runs past
`probe_factor` times that (never sooner than `min_probe_after_s`), it asks every peer of the route directly
for a short info call. A peer that does not answer within `probe_timeout_s` is taken for dead: the step is
abandoned and PeerSilent names that peer, so the failover starts at once. If every peer answers, the step is
only slow (a long prefill, a busy peer): the client waits on and probes again one bound later, up to the
step timeout.

Expected step times are running averages kept per client (all its sessions run the same model on the same
swarm): seconds per decode step, and seconds per token of a multi-token step (prefill or replay).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from swarm.errors import TransportError
from swarm.routing.route import Stage
from swarm.types import NodeID

logger = logging.getLogger(__name__)

T = TypeVar("T")
Probe = Callable[[Sequence[Stage], float], Awaitable[NodeID | None]]  # (stages, timeout_s) -> a silent peer
AVERAGE_WEIGHT = 0.2  # weight of the newest step in the running average of step times


class PeerSilent(TransportError):
    """A peer of the route did not answer our own probe while a step was outstanding: taken for dead.

    Unlike a hop's claim that a later hop failed, this is first-hand: the client asked the peer itself."""

    def __init__(self, peer_id: NodeID, waited_s: float) -> None:
        super().__init__(f"peer {peer_id} did not answer a probe after the step ran {waited_s:.1f} s")
        self.failed_peer_id = peer_id
        self.waited_s = waited_s


@dataclass(frozen=True)
class LivenessConfig:
    """When an outstanding step makes the client probe its route's peers."""

    probe_factor: float = 4.0  # probe once a step runs this many times its expected time...
    min_probe_after_s: float = 1.0  # ...but never sooner than this, seconds
    probe_timeout_s: float = 1.0  # a peer that does not answer an info call in this long is taken for dead

    def __post_init__(self) -> None:
        if self.probe_factor < 1 or self.min_probe_after_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError(
                "need probe_factor >= 1, min_probe_after_s > 0 and probe_timeout_s > 0, got "
                f"{self.probe_factor}, {self.min_probe_after_s}, {self.probe_timeout_s}"
            )


class StepWatch:
    """Runs steps under a deadline, probing the route when one runs long (see the module docstring)."""

    def __init__(
        self,
        probe: Probe,
        config: LivenessConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.config = config or LivenessConfig()
        self.clock = clock
        self.decode_s: float | None = None  # running average of one-token steps, seconds
        self.token_s: float | None = None  # running average of seconds per token of multi-token steps
        self.probes = 0  # probes sent (each asks every peer of the route)
        self.silent_found = 0  # probes that found a silent peer

    def bound_s(self, tokens: int) -> float:
        """How long a step of `tokens` tokens may run before the route is probed."""
        expected = self.decode_s if tokens == 1 else (self.token_s * tokens if self.token_s else None)
        if expected is None:
            return self.config.min_probe_after_s
        return max(self.config.min_probe_after_s, self.config.probe_factor * expected)

    async def run(self, step: Awaitable[T], stages: Sequence[Stage], tokens: int, timeout_s: float) -> T:
        """The result of `step` (a step of `tokens` tokens through `stages`), within `timeout_s`.

        TimeoutError at the deadline; PeerSilent as soon as a probe finds a peer of the route silent."""
        task = asyncio.ensure_future(step)
        began = self.clock()
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    done, _ = await asyncio.wait({task}, timeout=self.bound_s(tokens))
                    if done:
                        break
                    silent = await self._probe(stages)
                    if silent is not None and not task.done():
                        self.silent_found += 1
                        raise PeerSilent(silent, self.clock() - began)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        result = task.result()  # raises the step's own error
        self._observe(tokens, self.clock() - began)
        return result

    async def _probe(self, stages: Sequence[Stage]) -> NodeID | None:
        self.probes += 1
        silent = await self.probe(stages, self.config.probe_timeout_s)
        if silent is not None:
            logger.warning("peer %s did not answer a probe during a long step", str(silent)[-8:])
        return silent

    def _observe(self, tokens: int, seconds: float) -> None:
        if tokens == 1:
            self.decode_s = _average(self.decode_s, seconds)
        elif tokens > 1:
            self.token_s = _average(self.token_s, seconds / tokens)


def _average(before: float | None, sample: float) -> float:
    return sample if before is None else before + AVERAGE_WEIGHT * (sample - before)
