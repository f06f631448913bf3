"""What a peer measures about itself: compute speed per layer, how many layers fit, and its links to others.

Compute is measured on the peer's own loaded blocks (one layer, so the numbers are per layer and independent of
how many it holds): decode at batch 1 and batch 8 through real sessions, prefill as one stateless step. Memory
gives ``max_layers``: the weights of that many layers plus the KV cache they need for ``cache_tokens``.
Links are measured with probe RPCs to a bounded set of live peers (the k lowest-RTT ones seen so far plus a
random sample), refreshed periodically, so the cost stays constant as the swarm grows: RTT by small pings,
bandwidth (both directions, by probes sized for the link: swarm.transport.linkprobe) only rarely.
Two peers probing each other's bandwidth at once share the link and both read it slow (the sized probes queue
behind each other): the peer with the greater id gives way, dropping its measurement as soon as the other's
sized probes arrive, and measures again once the other has been quiet for ``poll_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from swarm.dht import LinkMeasure, PeerRecord
from swarm.dht.schemas import MAX_BANDWIDTH_BYTES_S, MAX_RTT_S
from swarm.dht.traffic import TrafficMeter
from swarm.models.blocks import BlockRange, Step
from swarm.models.spec import ModelSpec
from swarm.peer.config import LinkConfig
from swarm.transport.calls import call_probe
from swarm.transport.linkprobe import LinkTiming, ProbeSizes, measure_both_ways
from swarm.types import LayerRange
from swarm.wire import ProbeRequest

logger = logging.getLogger(__name__)

# When choosing the k nearest, an announced link's RTT counts as this much of itself, less this margin: RTTs
# jitter, and each newcomer to the k costs a bandwidth probe.
INCUMBENT_FAVOUR = 0.8
INCUMBENT_MARGIN_S = 0.002
PROBE_OVERHEAD_BYTES = 64  # a probe message's framing, counted with its payload (an estimate)
MEASURE_DEADLINE_PROBES = 4  # one bandwidth measurement may take this many probe timeouts at most
MAX_PROBERS_KEPT = 4096  # peers whose last probe time we keep (strangers' probes cannot grow it)


@dataclass(frozen=True)
class ComputeMeasure:
    decode_layer_tokens_s_b1: float  # decode tokens/s through one layer, one session
    decode_layer_tokens_s_b8: float  # total decode tokens/s of a batch of sessions through one layer
    prefill_layer_tokens_s: float  # prefill tokens/s through one layer


def measure_compute(
    blocks: BlockRange, *, decode_steps: int = 8, batch: int = 8, prefill_tokens: int = 128
) -> ComputeMeasure:
    """Time one layer of ``blocks``. Runs torch: call it on the executor thread."""
    spec, layer = blocks.spec, blocks.range.start
    context = 16
    length = context + decode_steps + 2
    batch = max(1, min(batch, blocks.free_cache_tokens // length))
    if batch == 0 or blocks.free_cache_tokens < length:
        raise ValueError(
            f"need {length} free cache tokens to measure decode speed, have {blocks.free_cache_tokens}"
        )

    def hidden(tokens: int) -> torch.Tensor:
        return torch.randn(tokens, spec.hidden_size, device=blocks.device).to(blocks.dtype) * 0.1

    def decode_rate(n_sessions: int) -> float:
        ids = [f"measure-{os.getpid()}-{n_sessions}-{i}" for i in range(n_sessions)]
        for sid in ids:
            blocks.open_session(sid, length)
        try:
            blocks.forward([Step(sid, hidden(context), layer, layer + 1, 0) for sid in ids])
            blocks.forward([Step(sid, hidden(1), layer, layer + 1, context) for sid in ids])  # warm-up
            sync_device(blocks.device)
            started = time.perf_counter()
            for i in range(decode_steps):
                blocks.forward([Step(sid, hidden(1), layer, layer + 1, context + 1 + i) for sid in ids])
            sync_device(blocks.device)
            return n_sessions * decode_steps / (time.perf_counter() - started)
        finally:
            for sid in ids:
                blocks.close_session(sid)

    b1 = decode_rate(1)
    b8 = decode_rate(batch)
    blocks.forward([Step(None, hidden(prefill_tokens), layer, layer + 1, 0)])  # warm-up
    sync_device(blocks.device)
    started = time.perf_counter()
    blocks.forward([Step(None, hidden(prefill_tokens), layer, layer + 1, 0)])
    sync_device(blocks.device)
    prefill = prefill_tokens / (time.perf_counter() - started)
    return ComputeMeasure(b1, b8, prefill)


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs it after the call returns); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_budget_bytes(device: str, max_memory_gb: float | None) -> int:
    """The memory this peer may use: the user's cap, else 90% of free GPU memory or 60% of available RAM."""
    if max_memory_gb is not None:
        return int(max_memory_gb * 1024**3)
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free * 0.9)
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        return int(fields.get("MemAvailable", 0) * 0.6)
    except OSError:  # not Linux: assume a modest machine rather than guessing high
        return 4 * 1024**3


def _layer_bytes(spec: ModelSpec, dtype: str, cache_tokens: int, weight_bytes: int | None) -> int:
    """One layer's weights (``weight_bytes`` as held, else as loaded in ``dtype``) plus a KV cache of
    ``cache_tokens``."""
    weights = spec.layer_bytes(dtype) if weight_bytes is None else weight_bytes
    return weights + cache_tokens * spec.kv_bytes_per_token(dtype)


def max_layers_within(
    spec: ModelSpec, dtype: str, budget_bytes: int, cache_tokens: int, weight_bytes: int | None = None
) -> int:
    """Most layers whose weights (``weight_bytes`` a layer as its backend holds them: ModelSource.
    held_layer_bytes; else the dtype's) plus a KV cache of ``cache_tokens`` per layer fit in ``budget_bytes``."""
    per_layer = _layer_bytes(spec, dtype, cache_tokens, weight_bytes)
    return max(0, min(spec.num_layers, budget_bytes // max(per_layer, 1)))


def packing_bytes(
    spec: ModelSpec,
    dtype: str,
    budget_bytes: int,
    cache_tokens: int,
    layers: int,
    weight_bytes: int | None = None,
) -> int:
    """What the budget leaves, once ``layers`` layers' held weights and KV caches are counted, for copies of
    their weights beside them (BlockRange's ``pack_bytes``): the same for a range loaded at join and one a peer
    moves to."""
    return max(0, budget_bytes - layers * _layer_bytes(spec, dtype, cache_tokens, weight_bytes))


def choose_range(coverage: list[int], max_layers: int) -> LayerRange:
    """Petals-style: the window of ``max_layers`` layers that live peers cover least.

    Windows are compared by their least-covered layer, then by total coverage; ties go to the lowest start.
    """
    num_layers = len(coverage)
    size = max(1, min(max_layers, num_layers))
    best = min(
        range(num_layers - size + 1),
        key=lambda s: (min(coverage[s : s + size]), sum(coverage[s : s + size]), s),
    )
    return LayerRange(best, best + size)


def link_measure(timing: LinkTiming) -> LinkMeasure:
    """A measured link as announced: within the record's bounds (a probe faster than any interface is
    loopback noise, announced at the cap)."""

    def bounded(bytes_s: float) -> float:
        return min(max(bytes_s, 1.0), MAX_BANDWIDTH_BYTES_S)

    return LinkMeasure(
        rtt_s=min(timing.rtt_s, MAX_RTT_S),
        bandwidth_bytes_s=bounded(timing.up_bytes_s),
        reverse_bandwidth_bytes_s=bounded(timing.down_bytes_s),
    )


class LinkMonitor:
    """Keeps ``links`` (peer id -> LinkMeasure) fresh for the k peers nearest by RTT.

    Every refresh_s, small pings give the RTT to those k and to a random sample of the others (how nearer
    peers are found); every poll_s, peers new to the swarm as last read are pinged too. Bandwidth costs real
    bytes, so it is probed (swarm.transport.linkprobe) only when a peer first becomes one of the k, and again
    every bandwidth_refresh_s. Only the k are announced: the record stays small as the swarm grows. After the
    first k measurements (tried, measured or not), a later one (a peer new among the k, a re-measure) uses
    small probes (later_payload_bytes, later_rounds), one link per later_gap_s at most, the link it would
    displace announced meanwhile: an idle peer's probes stay a trickle while RTT jitter reshuffles its k."""

    def __init__(
        self,
        p2p: P2P,
        own_peer_id: str,
        live_peers: Callable[[], Awaitable[dict[str, PeerRecord]]],
        config: LinkConfig | None = None,
        rng: random.Random | None = None,
        on_change: Callable[[Mapping[str, LinkMeasure]], None] = lambda links: None,
        traffic: TrafficMeter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.p2p = p2p
        self.own_peer_id = own_peer_id
        self.live_peers = live_peers
        self.config = config or LinkConfig()
        self.rng = rng or random.Random()
        self.clock = clock
        self.links: dict[str, LinkMeasure] = {}  # the k nearest, as announced
        self.rtts: dict[str, float] = {}  # every live peer pinged, latest RTT
        self._bandwidth: dict[str, tuple[float, float, float]] = {}  # peer -> (up, down, clock when measured)
        self.on_change = on_change  # told the links whenever they were re-measured
        self.traffic = traffic or TrafficMeter()
        self.probed_at: OrderedDict[str, float] = (
            OrderedDict()
        )  # peer id -> its last sized probe to us, oldest first
        self.yielding: dict[str, asyncio.Event] = {}  # peers we are measuring, set if we must give way
        self.sizes = ProbeSizes(
            min_bytes=self.config.min_payload_bytes,
            max_bytes=self.config.payload_bytes,
            probe_s=self.config.probe_s,
        )
        self.later_sizes = ProbeSizes(
            min_bytes=min(self.config.min_payload_bytes, self.config.later_payload_bytes),
            max_bytes=self.config.later_payload_bytes,
            probe_s=self.config.probe_s,
            rounds=self.config.later_rounds,
        )
        self._later_at = float("-inf")  # clock of the last later measurement
        self._full_measurements = 0  # measurements tried with full probes (at most k)

    def heard_probe(self, peer_id: str) -> None:
        """A sized probe from ``peer_id`` reached us: it is measuring our link's bandwidth (the probe handler
        calls this)."""
        self.probed_at[peer_id] = self.clock()
        self.probed_at.move_to_end(peer_id)
        if len(self.probed_at) > MAX_PROBERS_KEPT:  # anyone may probe: forget the longest quiet
            self.probed_at.popitem(last=False)
        if peer_id < self.own_peer_id and peer_id in self.yielding:
            self.yielding[peer_id].set()

    def _being_probed(self, peer_id: str) -> bool:
        return self.clock() - self.probed_at.get(peer_id, float("-inf")) < self.config.poll_s

    def pick(self, candidates: list[str]) -> list[str]:
        """The k nearest by last RTT, plus a random sample of the rest."""
        known = sorted((p for p in candidates if p in self.rtts), key=lambda p: self.rtts[p])
        nearest = known[: self.config.nearest]
        rest = [p for p in candidates if p not in nearest]
        return nearest + self.rng.sample(
            rest, min(self.config.sample + max(0, self.config.nearest - len(nearest)), len(rest))
        )

    def nearest(self) -> list[str]:
        """The k peers of lowest RTT; a peer announced now keeps its place unless another is clearly nearer
        (RTTs jitter, and each newcomer to the k costs a bandwidth probe)."""

        def rank(p: str) -> float:
            rtt = self.rtts[p]
            return rtt * INCUMBENT_FAVOUR - INCUMBENT_MARGIN_S if p in self.links else rtt

        return sorted(self.rtts, key=rank)[: self.config.nearest]

    async def refresh(self, only_new: bool = False) -> None:
        """Ping a bounded set of peers (``only_new``: just live peers never pinged, within budget), then keep
        the k nearest, probing the bandwidth of those with none measured lately."""
        peers = await self.live_peers()
        candidates = [p for p in peers if p != self.own_peer_id]
        if only_new:
            budget = self.config.nearest + self.config.sample
            targets = [p for p in candidates if p not in self.rtts][:budget]
        else:
            targets = self.pick(candidates)
        for peer_id in targets:
            try:
                self.rtts[peer_id] = await self._ping(peer_id, peers[peer_id].maddrs)
            except Exception as e:  # an unreachable peer just has no link entry this round
                logger.debug("no RTT to %s: %s", peer_id[-8:], e)
                self.rtts.pop(peer_id, None)
        # Forget peers that left.
        self.rtts = {p: r for p, r in self.rtts.items() if p in peers}
        self._bandwidth = {p: b for p, b in self._bandwidth.items() if p in peers}
        links: dict[str, LinkMeasure] = {}
        # The first k measurements (tried, whether or not they succeeded) use full probes; the rest small ones.
        settled = self._full_measurements >= self.config.nearest
        for peer_id in self.nearest():
            bandwidth = self._bandwidth.get(peer_id)
            due = bandwidth is None or self.clock() - bandwidth[2] >= self.config.bandwidth_refresh_s
            if due and settled and self.clock() - self._later_at < self.config.later_gap_s:
                due = False  # one later measurement per later_gap_s: this one waits
            if due:
                if settled:
                    self._later_at = self.clock()
                else:
                    self._full_measurements += 1
                try:
                    sizes = self.later_sizes if settled else self.sizes
                    timing = await self._measure(peer_id, peers[peer_id].maddrs, sizes)
                except Exception as e:
                    logger.debug("bandwidth to %s not measured: %s", peer_id[-8:], e)
                else:
                    if timing is not None:  # else we gave way: measured on a later round
                        bandwidth = (timing.up_bytes_s, timing.down_bytes_s, self.clock())
                        self._bandwidth[peer_id] = bandwidth
            if bandwidth is not None:
                links[peer_id] = link_measure(LinkTiming(self.rtts[peer_id], bandwidth[0], bandwidth[1]))
        # A link a peer not measured yet displaced stays announced (and favoured) until that peer is measured.
        for peer_id in self.links:
            if len(links) < self.config.nearest and peer_id in self.rtts and peer_id in self._bandwidth:
                up, down, _at = self._bandwidth[peer_id]
                links.setdefault(peer_id, link_measure(LinkTiming(self.rtts[peer_id], up, down)))
        self.links = links
        self.on_change(self.links)

    async def _ping(self, peer_id: str, maddrs: list[str]) -> float:
        """The fastest of ``sizes.pings`` empty probes (seconds)."""
        best = float("inf")
        for _ in range(self.sizes.pings):
            started = time.perf_counter()
            await self._probe(peer_id, maddrs, 0, 0)
            best = min(best, time.perf_counter() - started)
        return best

    async def _measure(self, peer_id: str, maddrs: list[str], sizes: ProbeSizes) -> LinkTiming | None:
        """Both directions' bandwidth to ``peer_id``; None if we gave way to its own measurement of our link.
        The whole measurement has a deadline: a slow or hostile peer cannot stall the round."""
        if peer_id < self.own_peer_id and self._being_probed(peer_id):
            return None

        async def probe(sent: int, back: int) -> None:
            await self._probe(peer_id, maddrs, sent, back)

        give_way = self.yielding[peer_id] = asyncio.Event()
        measuring = asyncio.ensure_future(measure_both_ways(probe, sizes))
        yielded = asyncio.ensure_future(give_way.wait())
        try:
            async with asyncio.timeout(MEASURE_DEADLINE_PROBES * self.config.timeout_s):
                await asyncio.wait([measuring, yielded], return_when=asyncio.FIRST_COMPLETED)
        finally:
            del self.yielding[peer_id]
            for task in (measuring, yielded):
                if not task.done():
                    task.cancel()
            await asyncio.gather(measuring, yielded, return_exceptions=True)  # nothing left unawaited
        return None if measuring.cancelled() else measuring.result()

    async def _probe(self, peer_id: str, maddrs: list[str], sent: int, back: int) -> None:
        self.traffic.add(
            "link_probes", sent=sent + PROBE_OVERHEAD_BYTES, received=back + PROBE_OVERHEAD_BYTES
        )
        request = ProbeRequest(payload=bytes(sent), reply_bytes=back)
        await call_probe(self.p2p, peer_id, request, maddrs=maddrs, timeout_s=self.config.timeout_s)

    async def run(self) -> None:
        """A full round every refresh_s; in between, every poll_s, ping peers that just joined."""
        last_full = float("-inf")
        while True:
            full = time.monotonic() - last_full >= self.config.refresh_s
            try:
                await self.refresh(only_new=not full)
                if full:
                    last_full = time.monotonic()
            except Exception as e:  # one failed round (DHT timeout, a bug) must not stop measuring
                logger.warning("link measurement failed: %r", e)
            await asyncio.sleep(self.config.poll_s)
