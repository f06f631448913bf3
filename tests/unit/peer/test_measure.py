"""Layer choice and memory sizing: pure functions on hand-computed inputs."""

from __future__ import annotations

import asyncio
import random

import pytest

from swarm.dht import PeerRecord
from swarm.models.spec import ModelSpec
from swarm.peer.measure import LinkConfig, LinkMonitor, choose_range, max_layers_within
from swarm.transport.linkprobe import ProbeSizes
from swarm.types import LayerRange
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(10)

SPEC = ModelSpec("m", "llama", 10, 64, 4, 2, 100, "float32", "h", intermediate_size=128)


def test_choose_range_takes_the_least_covered_window() -> None:
    assert choose_range([0] * 6, 2) == LayerRange(0, 2)
    assert choose_range([1, 1, 0, 0, 1, 1], 2) == LayerRange(2, 4)
    assert choose_range([2, 2, 1, 1, 1, 0], 3) == LayerRange(3, 6)
    # Equal minimum: the window with less total coverage wins.
    assert choose_range([0, 5, 5, 0, 1, 1], 3) == LayerRange(3, 6)


def test_choose_range_clamps_to_the_model() -> None:
    assert choose_range([3, 3, 3], 10) == LayerRange(0, 3)
    assert choose_range([3, 0, 3], 0) == LayerRange(1, 2)


def test_max_layers_within_counts_weights_and_cache() -> None:
    per_layer = SPEC.layer_bytes("float32") + 100 * SPEC.kv_bytes_per_token("float32")
    assert max_layers_within(SPEC, "float32", 3 * per_layer, 100) == 3
    assert max_layers_within(SPEC, "float32", 3 * per_layer - 1, 100) == 2
    assert max_layers_within(SPEC, "float32", 10**12, 100) == SPEC.num_layers
    assert max_layers_within(SPEC, "float32", 0, 100) == 0
    # 16-bit weights and cache fit twice as many layers.
    assert max_layers_within(SPEC, "bfloat16", 3 * per_layer, 100) == 6


def test_link_monitor_picks_nearest_plus_a_bounded_sample() -> None:
    monitor = LinkMonitor(None, "me", None, LinkConfig(nearest=2, sample=1), rng=random.Random(0))  # type: ignore[arg-type]
    monitor.rtts = {f"p{i}": 0.01 * (i + 1) for i in range(5)}
    candidates = [f"p{i}" for i in range(10)]
    picked = monitor.pick(candidates)
    assert picked[:2] == ["p0", "p1"] and len(picked) == 3 and len(set(picked)) == 3
    fresh = LinkMonitor(None, "me", None, LinkConfig(nearest=2, sample=1), rng=random.Random(0))  # type: ignore[arg-type]
    assert len(fresh.pick(candidates)) == 3  # nothing measured yet: a random sample of nearest + sample


class _Monitor(LinkMonitor):
    """A link monitor whose probes answer at once, after a per-peer delay the test sets (no network)."""

    def __init__(self, peers: list[str], config: LinkConfig, clock: list[float]) -> None:
        records = {p: peer_record(p) for p in ["me", *peers]}

        async def live() -> dict[str, PeerRecord]:
            return records

        super().__init__(None, "me", live, config, rng=random.Random(0), clock=lambda: clock[0])  # type: ignore[arg-type]
        self.rtt = {p: 0.01 * (i + 1) for i, p in enumerate(peers)}
        self.probes: list[tuple[str, int, int]] = []

    async def _ping(self, peer_id: str, maddrs: list[str]) -> float:
        self.probes.append((peer_id, 0, 0))
        return self.rtt[peer_id]

    async def _probe(self, peer_id: str, maddrs: list[str], sent: int, back: int) -> None:
        self.probes.append((peer_id, sent, back))


def test_link_monitor_announces_the_k_nearest_and_probes_bandwidth_rarely() -> None:
    async def body() -> None:
        clock = [0.0]
        peers = [f"p{i}" for i in range(8)]
        monitor = _Monitor(peers, LinkConfig(nearest=2, sample=2, bandwidth_refresh_s=600.0), clock)
        for _ in range(12):  # the random samples find every peer's RTT within a few rounds
            await monitor.refresh()
            clock[0] += 30.0
        assert set(monitor.links) == {"p0", "p1"}  # only the k nearest are announced
        probed = {p for p, sent, back in monitor.probes if sent or back}
        assert probed <= {"p0", "p1", *peers[:4]}  # bandwidth only for peers that were among the nearest
        monitor.probes.clear()
        await monitor.refresh()
        assert all(sent == back == 0 for _, sent, back in monitor.probes)  # within bandwidth_refresh_s: pings
        clock[0] += 600.0
        # Due again: re-measured with small probes, one link per later_gap_s (the k were measured long ago).
        remeasured = []
        for _ in range(2):
            monitor.probes.clear()
            await monitor.refresh()
            sized = [(p, sent, back) for p, sent, back in monitor.probes if sent or back]
            assert len({p for p, _, _ in sized}) == 1
            assert all(max(sent, back) <= monitor.config.later_payload_bytes for _, sent, back in sized)
            assert len(sized) <= 2 * monitor.config.later_rounds
            remeasured.append(sized[0][0])
            clock[0] += monitor.config.refresh_s
            monitor.probes.clear()
            await monitor.refresh()  # within later_gap_s: pings only, both links still announced
            assert all(sent == back == 0 for _, sent, back in monitor.probes)
            assert set(monitor.links) == {"p0", "p1"}
            clock[0] += monitor.config.later_gap_s
        assert sorted(remeasured) == ["p0", "p1"]
        # A peer only a little nearer than an announced one (RTT jitter) does not take its place.
        monitor.rtt["p2"] = monitor.rtt["p1"] - 0.001
        for _ in range(6):
            await monitor.refresh()
        assert set(monitor.links) == {"p0", "p1"}

    asyncio.run(body())


def test_the_first_k_links_are_measured_at_once_with_full_probes() -> None:
    async def body() -> None:
        clock = [0.0]
        monitor = _Monitor(["p0", "p1", "p2"], LinkConfig(nearest=2, sample=1), clock)
        await monitor.refresh()
        sized = [(p, sent, back) for p, sent, back in monitor.probes if sent or back]
        assert {p for p, _, _ in sized} == set(monitor.links) and len(monitor.links) == 2
        # answered at once (lost in the noise): the probes grow to the full size
        assert max(max(sent, back) for _, sent, back in sized) == monitor.config.payload_bytes

    asyncio.run(body())


def test_a_peer_new_among_the_k_waits_its_turn_and_the_link_it_displaces_stays() -> None:
    async def body() -> None:
        clock = [0.0]
        peers = [f"p{i}" for i in range(6)]
        config = LinkConfig(nearest=2, sample=4, later_gap_s=1000.0)
        monitor = _Monitor(peers, config, clock)  # sample 4 + nearest 2: every peer pinged each round
        await monitor.refresh()
        assert set(monitor.links) == {"p0", "p1"}

        def sized() -> set[str]:
            return {p for p, sent, back in monitor.probes if sent or back}

        monitor.rtt["p5"] = 0.001  # clearly nearest: measured at once, small probes
        monitor.probes.clear()
        clock[0] += config.refresh_s
        await monitor.refresh()
        assert sized() == {"p5"} and set(monitor.links) == {"p5", "p0"}
        assert all(max(s, b) <= config.later_payload_bytes for _, s, b in monitor.probes)
        monitor.rtt["p4"] = 0.0005  # nearer still, but within later_gap_s of the last measurement
        monitor.probes.clear()
        clock[0] += config.refresh_s
        await monitor.refresh()
        assert sized() == set() and set(monitor.links) == {"p5", "p0"}
        clock[0] += config.later_gap_s
        monitor.probes.clear()
        await monitor.refresh()
        assert sized() == {"p4"} and set(monitor.links) == {"p4", "p5"}

    asyncio.run(body())


def test_full_probes_are_spent_on_the_first_k_tries_even_when_they_fail() -> None:
    """A busy peer whose first measurements time out does not go on probing at full size."""

    async def body() -> None:
        clock = [0.0]
        config = LinkConfig(nearest=2, sample=1)
        monitor = _Monitor(["p0", "p1", "p2"], config, clock)

        async def no_bandwidth(peer_id: str, maddrs: list[str], sizes: ProbeSizes) -> None:
            monitor.probes.append((peer_id, sizes.max_bytes, sizes.max_bytes))
            raise TimeoutError

        monitor._measure = no_bandwidth  # type: ignore[assignment, method-assign]
        for _ in range(4):
            await monitor.refresh()
            clock[0] += config.later_gap_s
        sized = [sent for _, sent, _ in monitor.probes if sent]
        assert sized[:2] == [config.payload_bytes] * 2
        assert sized[2:] and all(sent == config.later_payload_bytes for sent in sized[2:])

    asyncio.run(body())
