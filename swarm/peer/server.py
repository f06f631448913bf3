"""The peer process: join the DHT, pick and load layers, measure, serve RPCs, announce, leave cleanly.

run(config, stop)                       # returns after ``stop`` is set and the peer has left
  SwarmDHT.create                       # hivemind DHT + p2pd, reachability options off unless opted in
  choose layers (auto: least covered)   # from a DHT snapshot and the memory budget
  load blocks, measure compute          # on the executor thread
  TaskGroup: executor, announcer, idle-session reaper, link monitor, planner service
  dial-back check                       # another peer probes us: are we reachable?
  stop: refuse new sessions, drain open ones (grace), withdraw the record, stop the DHT
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import P2P

from swarm import PROTOCOL_VERSION
from swarm.dht import (
    Announcer,
    DHTConfig,
    Directory,
    DirectoryConfig,
    Election,
    ElectionConfig,
    PeerRecord,
    ReachabilityConfig,
    SwarmDHT,
    coverage,
)
from swarm.models.loading import ModelSource, resolve_model
from swarm.models.spec import ModelSpec
from swarm.peer.config import PeerConfig
from swarm.peer.executor import Executor
from swarm.peer.follow import FollowConfig, PlanFollower
from swarm.peer.handlers import HandlerConfig, PeerHandlers
from swarm.peer.measure import (
    ComputeMeasure,
    LinkConfig,
    LinkMonitor,
    choose_range,
    max_layers_within,
    measure_compute,
    memory_budget_bytes,
)
from swarm.peer.planner_service import PlannerConfig, PlannerService
from swarm.transport import call_probe, serve
from swarm.types import LayerRange
from swarm.wire import ProbeRequest

logger = logging.getLogger(__name__)

REACHABILITY_ADVICE = (
    "this peer is NOT reachable from the swarm: others cannot send it requests. If you are behind a home "
    "router, rerun with --use-relay --use-auto-relay (reach others through relays), or --nat-port-map (UPnP), "
    "or forward a port and pass --port N --announce-maddr /ip4/PUBLIC_IP/tcp/N"
)


class _Leave(Exception):
    """Raised inside the TaskGroup to stop every child once the peer has drained."""


@dataclass
class _PeerState:
    """The mutable facts a PeerRecord is built from."""

    spec: ModelSpec
    held: LayerRange
    max_layers: int
    memory_bytes: int
    state: str = "loading"
    compute: ComputeMeasure = ComputeMeasure(0.0, 0.0, 0.0)
    reachable: bool | None = None


async def run(config: PeerConfig, stop: asyncio.Event | None = None) -> None:
    """Run a peer until ``stop`` is set (the CLI sets it on SIGINT/SIGTERM), then leave cleanly."""
    stop = stop or asyncio.Event()
    began = time.monotonic()
    logger.info("resolving model %s", config.model)
    source = await asyncio.to_thread(resolve_model, config.model)
    spec = source.spec
    if config.layers != "auto":  # a bad range fails now, before we join the swarm
        LayerRange.parse(config.layers).check_within(spec.num_layers)
    dht_config = DHTConfig(
        initial_peers=config.initial_peers,
        host=config.host,
        port=config.port,
        identity_path=config.identity_path,
        reachability=ReachabilityConfig(
            use_relay=config.use_relay or config.use_auto_relay,
            use_auto_relay=config.use_auto_relay,
            nat_port_map=config.nat_port_map,
            auto_nat=config.auto_nat,
            announce_maddrs=config.announce_maddrs,
        ),
    )
    logger.info("joining the DHT (%s)", "new swarm" if not config.initial_peers else "via initial peers")
    dht = await SwarmDHT.create(dht_config, spec.weights_hash)
    try:
        p2p = await dht.replicate_p2p()
        await _serve(config, source, dht, p2p, stop, began)
    finally:
        dht.shutdown()
        logger.info("left the swarm")


async def _serve(
    config: PeerConfig, source: ModelSource, dht: SwarmDHT, p2p: P2P, stop: asyncio.Event, began: float
) -> None:
    spec = source.spec
    dtype = config.torch_dtype_name
    directory = Directory(dht, DirectoryConfig(ttl_s=config.record_ttl_s))
    budget = memory_budget_bytes(config.device, config.max_memory_gb)
    max_layers = max_layers_within(spec, dtype, budget, config.cache_tokens)
    if max_layers == 0:
        raise ValueError(
            f"a memory budget of {budget / 1024**3:.2f} GiB does not fit one layer of {spec.name} with "
            f"{config.cache_tokens} cache tokens: raise --max-memory-gb or lower --cache-tokens"
        )
    held = await _choose_layers(config, directory, spec, max_layers)
    peer = _PeerState(spec, held, max_layers, budget)
    maddrs = dht.visible_maddrs()
    name = config.name or dht.peer_id[-6:]
    logger.info(
        "loading layers %s of %s (%d layers fit in %.2f GiB)", held, spec.name, max_layers, budget / 1024**3
    )
    blocks = await asyncio.to_thread(
        source.load_blocks, held.start, held.end, config.device, dtype, config.cache_tokens
    )
    executor = Executor(blocks, name=f"torch-{config.device}")
    handlers = PeerHandlers(
        peer_id=dht.peer_id,
        name=name,
        p2p=p2p,
        executor=executor,
        spec=spec,
        held=held,
        dtype=blocks.dtype,
        config=HandlerConfig(session_idle_timeout_s=config.session_idle_timeout_s),
        state=lambda: peer.state,
    )
    links = LinkMonitor(p2p, dht.peer_id, directory.read_peers, LinkConfig(refresh_s=config.link_refresh_s))

    def record() -> PeerRecord:
        return PeerRecord(
            peer_id=dht.peer_id,
            name=name,
            maddrs=maddrs,
            protocol_version=PROTOCOL_VERSION,
            model_name=spec.name,
            model_hash=spec.weights_hash,
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            device=str(blocks.device),
            dtype=dtype,
            memory_bytes=budget,
            state=peer.state,  # type: ignore[arg-type]
            range_start=handlers.held.start,  # the follower moves it to the plan's range
            range_end=handlers.held.end,
            decode_layer_tokens_s_b1=peer.compute.decode_layer_tokens_s_b1,
            decode_layer_tokens_s_b8=peer.compute.decode_layer_tokens_s_b8,
            prefill_layer_tokens_s=peer.compute.prefill_layer_tokens_s,
            max_layers=max_layers,
            cache_tokens_total=handlers.cache_tokens_total,
            free_cache_tokens=handlers.free_cache_tokens if peer.state == "serving" else 0,
            active_sessions=len(handlers.sessions),
            load=min(1.0, 1.0 - handlers.free_cache_tokens / max(1, handlers.cache_tokens_total)),
            links=dict(links.links),
            reachable=peer.reachable,
            updated_at=0.0,
        )

    announcer = Announcer(directory, record)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(executor.run())
            logger.info("measuring compute speed of one layer")
            peer.compute = await executor.call(lambda: measure_compute(blocks))
            logger.info(
                "measured per layer: decode %.0f tok/s (batch 1), %.0f tok/s (batch 8), prefill %.0f tok/s",
                peer.compute.decode_layer_tokens_s_b1,
                peer.compute.decode_layer_tokens_s_b8,
                peer.compute.prefill_layer_tokens_s,
            )
            await serve(p2p, handlers)
            peer.state = "serving"
            tg.create_task(announcer.run())
            tg.create_task(handlers.run())
            tg.create_task(links.run())
            tg.create_task(_announce_link_changes(directory, links, record))
            _start_planner(tg, config, directory)
            if config.follow_plan:
                tg.create_task(
                    _follower(config, directory, source, executor, handlers, max_layers, record).run()
                )
            async with asyncio.timeout(60):
                await announcer.announced.wait()
            logger.info("serving layers %s as %s after %.1f s", held, dht.peer_id, time.monotonic() - began)
            if config.maddr_file:
                _write_atomic(Path(config.maddr_file), "\n".join(maddrs) + "\n")
            print(
                "\n".join(["Peer is serving. Others join with:", *[f"  --initial-peers {m}" for m in maddrs]])
            )
            peer.reachable = await _check_reachable(p2p, directory, dht.peer_id, maddrs)
            await stop.wait()
            logger.info(
                "leaving: no new sessions; %d open ones get %.0f s",
                len(handlers.sessions),
                config.shutdown_grace_s,
            )
            peer.state = "leaving"
            handlers.accepting = False
            try:
                async with asyncio.timeout(5):
                    await directory.announce(record())
            except (TimeoutError, OSError, RuntimeError) as e:
                logger.warning("could not announce that we are leaving: %s", e)
            await handlers.drain(config.shutdown_grace_s)
            raise _Leave
    except* _Leave:
        pass


async def _announce_link_changes(
    directory: Directory, links: LinkMonitor, record: Callable[[], PeerRecord]
) -> None:
    """Announce as soon as we have links to new peers, instead of waiting for the next refresh."""
    while True:
        await links.changed.wait()
        links.changed.clear()
        try:
            async with asyncio.timeout(10):
                await directory.announce(record())
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.debug("announce after a link change failed: %s", e)


async def _choose_layers(
    config: PeerConfig, directory: Directory, spec: ModelSpec, max_layers: int
) -> LayerRange:
    if config.layers != "auto":
        held = LayerRange.parse(config.layers)
        held.check_within(spec.num_layers)
        return held
    try:
        snapshot = await directory.snapshot()
        counts = coverage(snapshot, spec.num_layers)
    except (TimeoutError, OSError, RuntimeError) as e:
        logger.warning("could not read the swarm (%s): choosing layers as if it were empty", e)
        counts = [0] * spec.num_layers
    held = choose_range(counts, max_layers)
    logger.info("layers auto: coverage %s -> %s", counts, held)
    return held


async def _check_reachable(p2p: P2P, directory: Directory, own_id: str, maddrs: list[str]) -> bool | None:
    """Ask another live peer to dial us back; None when we are alone."""
    try:
        others = {pid: r for pid, r in (await directory.read_peers()).items() if pid != own_id}
    except (TimeoutError, OSError, RuntimeError):
        return None
    for peer_id, other in list(others.items())[:3]:
        try:
            reply = await call_probe(
                p2p,
                peer_id,
                ProbeRequest(dial_back_peer_id=own_id, dial_back_maddrs=tuple(maddrs)),
                maddrs=other.maddrs,
                timeout_s=10.0,
            )
        except Exception as e:  # that peer is down: ask the next one
            logger.debug("dial-back request to %s failed: %s", peer_id[-8:], e)
            continue
        if reply.dial_back_ok:
            logger.info("reachability: %s dialled us back", peer_id[-8:])
            return True
        logger.warning(
            "%s (%s could not dial back: %s)", REACHABILITY_ADVICE, peer_id[-8:], reply.dial_back_error
        )
        return False
    return None


def _start_planner(tg: asyncio.TaskGroup, config: PeerConfig, directory: Directory) -> None:
    """Stand for planner: the election runs always, the planner service plans while we hold the lease."""
    if not config.plan:
        return
    election = Election(directory, ElectionConfig(lease_s=config.planner_lease_s))
    tg.create_task(election.run())
    tg.create_task(
        PlannerService(directory, election, PlannerConfig(check_interval_s=config.plan_check_s)).run()
    )


def _follower(
    config: PeerConfig,
    directory: Directory,
    source: ModelSource,
    executor: Executor,
    handlers: PeerHandlers,
    max_layers: int,
    record: Callable[[], PeerRecord],
) -> PlanFollower:
    """Move to the layers the published plan gives us (announcing each change at once)."""

    async def announce() -> bool:
        return await directory.announce(record())

    follow = FollowConfig(
        check_interval_s=config.plan_check_s,
        handover_timeout_s=config.handover_timeout_s,
        session_grace_s=config.shutdown_grace_s,
    )
    return PlanFollower(
        directory=directory,
        source=source,
        executor=executor,
        handlers=handlers,
        max_layers=max_layers,
        announce=announce,
        config=follow,
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
