"""Link probes sized for the link: within 10% of the configured bandwidth each way, on a thin long link too,
with bounded traffic. The link is a small model of TCP (slow start per direction, window kept between
back-to-back probes) on a virtual clock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator

import pytest

from swarm.transport.linkprobe import LinkTiming, ProbeSizes, measure_both_ways

INITIAL_WINDOW_BYTES = 10 * 1460  # Linux's initial congestion window


class ModelLink:
    """One round trip `rtt_s`, `up`/`down` bytes/s; each direction's window starts at 10 segments and grows by
    the bytes acknowledged (slow start), so it doubles per round trip while a transfer is window-limited."""

    def __init__(
        self, rtt_s: float, up_bytes_s: float, down_bytes_s: float, late_s: Callable[[], float] = lambda: 0.0
    ) -> None:
        self.rtt_s = rtt_s
        self.late_s = late_s  # extra time each call takes (a busy host, a queue on the way)
        self.rate = {"up": up_bytes_s, "down": down_bytes_s}
        self.window = {"up": INITIAL_WINDOW_BYTES, "down": INITIAL_WINDOW_BYTES}
        self.now = 0.0
        self.sent = {"up": 0, "down": 0}

    def clock(self) -> float:
        return self.now

    def _transfer_s(self, direction: str, size: int) -> float:
        """Time for `size` bytes one way, less the final round trip (counted once per probe)."""
        rate, spent, left = self.rate[direction], 0.0, size
        while left > self.window[direction]:
            chunk = self.window[direction]
            spent += max(self.rtt_s, chunk / rate)  # window-limited: wait for the acks
            left -= chunk
            self.window[direction] += chunk
        self.window[direction] += left
        self.sent[direction] += size
        return spent + left / rate

    async def probe(self, sent: int, back: int) -> None:
        self.now += self.rtt_s + self._transfer_s("up", sent) + self._transfer_s("down", back) + self.late_s()


def measure(link: ModelLink, sizes: ProbeSizes | None = None) -> LinkTiming:
    return asyncio.run(measure_both_ways(link.probe, sizes, link.clock))


@pytest.mark.parametrize(
    ("rtt_s", "up_bytes_s", "down_bytes_s"),
    [
        (0.100, 2.5e6, 2.5e6),  # 20 Mbit/s, 50 ms one way
        (0.100, 2.5e6, 12.5e6),  # asymmetric: 20 Mbit/s up, 100 down
        (0.050, 12.5e6, 1.25e6),  # 100 up, 10 down
        (0.020, 125e6, 125e6),  # 1000 Mbit/s, 10 ms one way
        (0.0002, 1.25e9, 1.25e9),  # a LAN
    ],
)
def test_both_directions_measured_within_10_percent(
    rtt_s: float, up_bytes_s: float, down_bytes_s: float
) -> None:
    link = ModelLink(rtt_s, up_bytes_s, down_bytes_s)
    timing = measure(link)
    assert timing.rtt_s == pytest.approx(rtt_s)
    assert timing.up_bytes_s == pytest.approx(up_bytes_s, rel=0.1)
    assert timing.down_bytes_s == pytest.approx(down_bytes_s, rel=0.1)


def test_a_thin_link_is_probed_lightly() -> None:
    sizes = ProbeSizes()
    link = ModelLink(0.1, 2.5e6, 2.5e6)
    measure(link, sizes)
    # About min_bytes + two probes of probe_s at 20 Mbit/s: far below rounds * max_bytes.
    for direction in ("up", "down"):
        assert link.sent[direction] <= sizes.min_bytes + 2 * sizes.probe_s * 2.5e6 + 1
    assert link.now < 2.0  # seconds of probing, pings included


def test_one_large_probe_on_a_fresh_window_would_underestimate() -> None:
    # Why probes are sized: the old single 256 KiB probe spends most of its time in slow start.
    link = ModelLink(0.1, 2.5e6, 2.5e6)
    single = ProbeSizes(min_bytes=256 * 1024, max_bytes=256 * 1024, rounds=1)
    assert measure(link, single).up_bytes_s < 0.5 * 2.5e6


def late_pings_first(late_s: float) -> Callable[[], float]:
    """The first round of pings all come back ``late_s`` late (a busy host); everything after is on time."""
    delays: Iterator[float] = iter([late_s] * ProbeSizes().pings)
    return lambda: next(delays, 0.0)


@pytest.mark.parametrize("down_bytes_s", [2.5e6, 12.5e6])
def test_late_pings_do_not_make_a_probe_look_instant(down_bytes_s: float) -> None:
    # 10 ms late pings on a 100 ms link: a 32 KiB probe at 100 Mbit/s crosses in 2.6 ms, so against the late
    # RTT it would come back "before" the round trip and read as a near-infinite rate.
    link = ModelLink(0.1, 2.5e6, down_bytes_s, late_pings_first(0.010))
    timing = measure(link)
    assert timing.rtt_s == pytest.approx(0.1)
    assert timing.up_bytes_s == pytest.approx(2.5e6, rel=0.1)
    assert timing.down_bytes_s == pytest.approx(down_bytes_s, rel=0.1)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("up_bytes_s", "down_bytes_s"), [(2.5e6, 12.5e6), (12.5e6, 2.5e6)])
def test_jitter_on_a_long_link_keeps_rates_near(seed: int, up_bytes_s: float, down_bytes_s: float) -> None:
    # Every call, ping or probe, up to 3 ms late at random: the figures stay within a quarter, no reading
    # runs away on a probe that jitter made look fast.
    rng = random.Random(seed)
    link = ModelLink(0.1, up_bytes_s, down_bytes_s, lambda: rng.uniform(0.0, 0.003))
    timing = measure(link)
    assert timing.rtt_s == pytest.approx(0.1, abs=0.003)
    assert timing.up_bytes_s == pytest.approx(up_bytes_s, rel=0.25)
    assert timing.down_bytes_s == pytest.approx(down_bytes_s, rel=0.25)


def test_probe_traffic_is_bounded_by_rounds_and_max_bytes() -> None:
    sizes = ProbeSizes(min_bytes=1024, max_bytes=64 * 1024, rounds=4)
    link = ModelLink(0.001, 1e12, 1e12)  # so fast that every estimate asks for the largest probe
    measure(link, sizes)
    assert link.sent["up"] <= 1024 + 3 * 64 * 1024
    assert link.sent["down"] <= 1024 + 3 * 64 * 1024


@pytest.mark.parametrize(
    "bad", [{"min_bytes": 0}, {"min_bytes": 10, "max_bytes": 5}, {"rounds": 0}, {"pings": 0}]
)
def test_bad_sizes_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ProbeSizes(**bad)  # type: ignore[arg-type]
