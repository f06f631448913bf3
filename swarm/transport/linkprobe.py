"""Measuring a link in both directions with probes sized for the link.

A probe of n bytes takes one round trip plus n / bandwidth, once the sender's TCP window is open. A fresh or
idle connection opens its window over several round trips (slow start), so one large probe on a long thin
link (20 Mbit/s, 50 ms one way) mostly measures round trips, and a large probe costs a thin link dearly.
So, per direction:

  1. a small probe (``min_bytes``): a first estimate, and it opens the window;
  2. right after, while the window is open, a probe sized to take about ``probe_s`` on the link at the best
     estimate so far, within [min_bytes, max_bytes] and no larger than the bytes sent so far (the window has
     grown by those: the probe crosses in one round trip); repeated (``rounds`` probes at most) while the
     estimate or the size still grows by half or more, since an estimate taken in slow start is low.

Bandwidth = bytes / (probe time - RTT), the best over the direction's probes: delays (slow start, a busy
peer) only ever make a probe slower, so the largest figure is the nearest. RTT is the best of ``pings``
empty probes before each direction (and of the probes themselves). A probe whose transfer time is within the
RTT's noise (``NOISE`` of it) gives no rate, only a cue to send a larger one: on a long link a small probe's
few milliseconds are jitter, not bandwidth. Upload sends the bytes and asks nothing back; download sends nothing and asks them back
(ProbeRequest.reply_bytes), so one peer measures both directions of its link. Traffic per direction and
measurement is at most ``rounds * max_bytes`` (sizes double at most: min_bytes * (2 ** rounds - 1) when that
is less); on a 20 Mbit/s link about min_bytes + 2 * probe_s * 2.5 MB/s.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Probe = Callable[[int, int], Awaitable[None]]  # (bytes sent, bytes asked back) -> returns once answered
Clock = Callable[[], float]

MIN_TRANSFER_S = 1e-6  # a probe no slower than a ping (loopback) still gives a finite bandwidth
NOISE = 0.05  # a transfer shorter than this share of the RTT is read as noise, not as a rate
SETTLED = 1.5  # an estimate (or probe size) that grows less than this per probe has settled


@dataclass(frozen=True)
class ProbeSizes:
    """How a link is probed."""

    pings: int = 3  # empty probes; the fastest is the RTT
    min_bytes: int = 32 * 1024  # the first probe of each direction
    max_bytes: int = 256 * 1024  # the largest probe
    probe_s: float = 0.05  # target time of a sized probe on the link
    rounds: int = 5  # most probes per direction

    def __post_init__(self) -> None:
        if (
            not (0 < self.min_bytes <= self.max_bytes)
            or self.pings < 1
            or self.rounds < 1
            or self.probe_s <= 0
        ):
            raise ValueError(f"bad probe sizes: {self}")


@dataclass(frozen=True)
class LinkTiming:
    """A link as measured from one end: RTT, and bytes/s each way."""

    rtt_s: float
    up_bytes_s: float  # from the measuring peer to the other
    down_bytes_s: float  # from the other to the measuring peer


async def _timed(probe: Probe, sent: int, back: int, clock: Clock) -> float:
    started = clock()
    await probe(sent, back)
    return clock() - started


def _floor_s(rtt_s: float) -> float:
    """The shortest transfer time read as a rate: below it a probe's time is the round trip's noise."""
    return NOISE * rtt_s + MIN_TRANSFER_S


def _best(probes: list[tuple[int, float]], rtt_s: float) -> float:
    """The best rate over ``probes`` ((size, time) pairs). A probe lost in the noise counts as crossing in the
    noise floor: a lower bound, large but finite on loopback, and never a division by a near-zero jitter."""
    return max(size / max(took - rtt_s, _floor_s(rtt_s)) for size, took in probes)


async def _direction(
    probe: Probe, upload: bool, rtt_s: float, sizes: ProbeSizes, clock: Clock
) -> list[tuple[int, float]]:
    """Up to ``sizes.rounds`` probes of one direction, each sized by the best estimate so far: (size, time)."""
    probes: list[tuple[int, float]] = []
    size, sent = sizes.min_bytes, 0
    for i in range(sizes.rounds):
        took = await _timed(probe, size if upload else 0, 0 if upload else size, clock)
        before = _best(probes, rtt_s) if probes else 0.0
        probes.append((size, took))
        sent += size
        best = _best(probes, rtt_s)
        wanted = int(min(max(best * sizes.probe_s, sizes.min_bytes), sizes.max_bytes))
        if took - rtt_s < _floor_s(rtt_s):
            wanted = sizes.max_bytes  # lost in the noise: larger, as fast as the window allows
        elif i > 0 and best < before * SETTLED and wanted < size * SETTLED:
            break  # the estimate settled and the probe is as large as it asks: another would tell little
        # In slow start the window grows by each byte acknowledged: a probe no larger than what was sent
        # so far fits in it, so it crosses in one round trip.
        size = max(min(wanted, sent), size)
    return probes


async def _rtt(probe: Probe, pings: int, clock: Clock) -> float:
    return min([await _timed(probe, 0, 0, clock) for _ in range(pings)])


async def measure_both_ways(
    probe: Probe, sizes: ProbeSizes | None = None, clock: Clock = time.perf_counter
) -> LinkTiming:
    """RTT and the bandwidth each way of the link ``probe`` crosses (see the module docstring)."""
    sizes = sizes or ProbeSizes()
    rtt_s = await _rtt(probe, sizes.pings, clock)
    up = await _direction(probe, True, rtt_s, sizes, clock)
    # Pinged again between the directions: on a busy host every ping of a round may come back late, and an
    # RTT read too long makes a small probe look instant (and its rate huge). Both directions are then read
    # with the least RTT seen, and a probe faster than that RTT shortens it: no probe beats a round trip.
    rtt_s = min(rtt_s, await _rtt(probe, sizes.pings, clock))
    down = await _direction(probe, False, rtt_s, sizes, clock)
    rtt_s = min([rtt_s, *(took for _, took in up + down)])
    return LinkTiming(rtt_s, _best(up, rtt_s), _best(down, rtt_s))
