"""Two peers measuring their link at once: the one with the greater id gives way, so neither reads the link
shared with the other's probes. Real libp2p nodes on loopback; the handlers hold probes only to fix the order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarm.dht.probe import start_listener, stop, visible_maddrs
from swarm.peer.config import LinkConfig
from swarm.peer.measure import LinkMonitor
from swarm.transport.serving import serve
from swarm.wire import ProbeReply, ProbeRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

POLL_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Prober:
    """Answers probes as a peer does and tells its monitor who sent a bandwidth probe; ``hold``, when set up,
    holds bandwidth probes until it is set."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.monitor: LinkMonitor | None = None
        self.first_probe: dict[str, asyncio.Event] = {}
        self.hold: asyncio.Event | None = None

    async def rpc_probe(self, request: ProbeRequest, remote_id: str) -> ProbeReply:
        assert self.monitor is not None
        if request.payload or request.reply_bytes:  # a bandwidth probe, as the peer's handler tells apart
            self.monitor.heard_probe(remote_id)
            self.first_probe.setdefault(remote_id, asyncio.Event()).set()
            if self.hold is not None:
                await self.hold.wait()
        return ProbeReply(self.peer_id, len(request.payload), bytes(request.reply_bytes))


async def _pair() -> tuple[list[object], list[LinkMonitor], list[Prober], Clock]:
    nodes = [await start_listener("127.0.0.1", 0, True) for _ in range(2)]
    nodes.sort(key=lambda n: n.peer_id.to_base58())  # [lower id, greater id]
    ids = [n.peer_id.to_base58() for n in nodes]
    maddrs = [await visible_maddrs(n) for n in nodes]
    clock = Clock()
    monitors, probers = [], []
    for i, node in enumerate(nodes):
        other = 1 - i
        record = SimpleNamespace(maddrs=maddrs[other])

        async def live(other_id: str = ids[other], record: SimpleNamespace = record) -> dict[str, object]:
            return {other_id: record}

        monitor = LinkMonitor(node, ids[i], live, LinkConfig(poll_s=POLL_S), clock=clock)  # type: ignore[arg-type]
        prober = Prober(ids[i])
        prober.monitor = monitor
        await serve(node, prober)  # type: ignore[arg-type]
        monitors.append(monitor)
        probers.append(prober)
    return nodes, monitors, probers, clock


async def _close(nodes: list[object]) -> None:
    for node in nodes:
        await stop(node)  # type: ignore[arg-type]


def test_the_greater_id_gives_way_mid_measurement_and_measures_once_the_other_is_quiet() -> None:
    async def body() -> None:
        nodes, (low, high), (low_prober, high_prober), clock = await _pair()
        try:
            # The greater id starts first; its first bandwidth probe is held at the lower id's end until the
            # lower id's own bandwidth probes reach it, so the two measurements overlap.
            low_prober.hold = asyncio.Event()
            high_round = asyncio.create_task(high.refresh())
            await low_prober.first_probe.setdefault(high.own_peer_id, asyncio.Event()).wait()
            low_round = asyncio.create_task(low.refresh())
            await high_prober.first_probe.setdefault(low.own_peer_id, asyncio.Event()).wait()
            low_prober.hold.set()
            await asyncio.gather(high_round, low_round)
            assert high.own_peer_id in low.links  # the lower id kept measuring
            assert low.own_peer_id not in high.links  # the greater one gave way
            await high.refresh(only_new=True)  # still within poll_s of the lower id's probes: waits
            assert low.own_peer_id not in high.links
            clock.now += POLL_S
            await high.refresh(only_new=True)
            link = high.links[low.own_peer_id]
            assert link.rtt_s > 0 and link.bandwidth_bytes_s > 0 and link.reverse_bandwidth_bytes_s > 0
        finally:
            await _close(nodes)

    asyncio.run(body())


def test_the_lower_id_does_not_give_way() -> None:
    async def body() -> None:
        nodes, (low, high), _, _ = await _pair()
        try:
            low.heard_probe(high.own_peer_id)  # the greater id is probing us right now
            await low.refresh()
            assert high.own_peer_id in low.links
        finally:
            await _close(nodes)

    asyncio.run(body())
