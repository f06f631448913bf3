"""The peer process: join the DHT, pick and load layers, measure, serve RPCs, announce, leave cleanly.

run(config, stop)                       # returns after ``stop`` is set and the peer has left
  dial-back check before joining        # can others dial us? if not, join through another peer's relay
  SwarmDHT.create                       # hivemind DHT + p2pd (UPnP, AutoNAT off unless opted in)
  choose layers (auto: least covered)   # from a DHT snapshot and the memory budget
  load blocks, measure compute          # on the executor thread
  TaskGroup: executor, announcer, idle-session reaper, link monitor, planner service, plan follower
  dial-back check                       # another peer dials us at our record's addresses (relayed or not)
  stop: refuse new sessions, drain open ones (grace), withdraw the record, stop the DHT

The Peer (swarm.peer.state) owns all mutable state; every component here gets it and acts through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path

from hivemind.p2p import P2P

from swarm.dht import (
    Announcer,
    DHTConfig,
    Directory,
    DirectoryConfig,
    Election,
    LeaseRecord,
    ModelShape,
    PeerRecord,
    SwarmDHT,
    coverage,
)
from swarm.dht.node import RELAY_FAILED, RELAY_OK
from swarm.dht.watch import SwarmWatch
from swarm.models.faults import OutputFaults, seed_of
from swarm.models.heap import freeze_loaded
from swarm.models.loading import ModelSource, resolve_model
from swarm.models.spec import ModelSpec
from swarm.peer.config import PeerConfig
from swarm.peer.executor import Executor
from swarm.peer.follow import PlanFollower
from swarm.peer.forwarding import Forwarder
from swarm.peer.handlers import PeerHandlers, reap_idle_sessions
from swarm.peer.handover import HANDOVER_LINGER_S, Handovers
from swarm.peer.measure import (
    LinkMonitor,
    choose_range,
    max_layers_within,
    measure_compute,
    memory_budget_bytes,
    packing_bytes,
)
from swarm.peer.planner_service import PlannerService
from swarm.peer.reach import (
    check_after_join,
    check_before_join,
    needs_check,
    relay_candidates,
    relaying_off_reason,
    watch_relays,
)
from swarm.peer.state import Identity, Peer, Served
from swarm.peer.turns import SharedDevice
from swarm.planner import ModelInfo
from swarm.transport import serve
from swarm.types import DTYPE_BYTES, LayerRange

logger = logging.getLogger(__name__)

REJOIN_PAUSE_S = (
    30.0  # after every relay left and no live peer could take us in: wait, then the initial peers
)

REACHABILITY_ADVICE = (
    "this peer is NOT reachable from the swarm: others cannot send it requests. If you are behind a home "
    "router, let it serve through another peer's relay (the default; check --no-relay and "
    "--no-relay-when-unreachable), or try --nat-port-map (UPnP), or forward a port and pass --host 0.0.0.0 "
    "--port N --announce-maddr /ip4/PUBLIC_IP/tcp/N"
)


BATCH_LOG_INTERVAL_S = 5.0
TRAFFIC_WRITE_S = 2.0  # how often --traffic-file is rewritten
RELAY_CHECK_ATTEMPTS = 5  # dial-backs through our relays before we say we cannot serve through them
RELAY_CHECK_PAUSE_S = 2.0


class _Leave(Exception):
    """Raised inside the TaskGroup to stop every child once the peer has drained."""


async def run(config: PeerConfig, stop: asyncio.Event | None = None) -> None:
    """Run a peer until ``stop`` is set (the CLI sets it on SIGINT/SIGTERM), then leave cleanly. A peer served
    through relays that all left the swarm leaves and joins again, through live peers others can dial."""
    stop = stop or asyncio.Event()
    began = time.monotonic()
    logger.info("resolving model %s", config.model)
    source = await asyncio.to_thread(resolve_model, config.model)
    if config.layers != "auto":  # a bad range fails now, before we join the swarm
        LayerRange.parse(config.layers).check_within(source.spec.num_layers)
    via: tuple[str, ...] = ()  # live peers to join through, when rejoining
    while True:
        dht_config = DHTConfig(
            initial_peers=(*via, *config.initial_peers),
            host=config.host,
            port=config.port,
            identity_path=config.identity_path,
            reachability=config.reachability,
            p2pd_threads=config.p2pd_threads,
            listen=config.listen,
        )
        dht_config = await _reach_before_join(config, dht_config)
        logger.info(
            "joining the DHT (%s)", "new swarm" if not dht_config.initial_peers else "via initial peers"
        )
        dht = await SwarmDHT.create(dht_config, source.spec.weights_hash)
        try:
            p2p = await dht.replicate_p2p()
            rejoin = await _serve(config, source, dht, p2p, stop, began)
        finally:
            await dht.aclose()
            logger.info("left the swarm")
        if rejoin is None:
            return
        via = rejoin
        if via:
            logger.info("rejoining through %s", ", ".join(m.rsplit("/p2p/", 1)[1][-8:] for m in via))
        else:  # nobody to rejoin through for now: the initial peers again, after a pause (or stop)
            logger.info("rejoining through the initial peers in %.0f s", REJOIN_PAUSE_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REJOIN_PAUSE_S)
            if stop.is_set():
                return


async def _serve(
    config: PeerConfig, source: ModelSource, dht: SwarmDHT, p2p: P2P, stop: asyncio.Event, began: float
) -> tuple[str, ...] | None:
    """Wire the components around one Peer under one TaskGroup; return once the peer has left: None when told
    to stop; when every relay it was served through had left, the live peers to rejoin through (maybe none)."""
    shape = ModelShape(source.spec.num_layers, source.spec.hidden_size)  # from the spec our DHT keys name
    directory_config = DirectoryConfig(ttl_s=config.record_ttl_s, lease_s=config.election.lease_s)
    directory = Directory(dht, directory_config, shape=shape)
    weight_bytes = await asyncio.to_thread(
        source.held_layer_bytes, config.device, config.torch_dtype_name, config.quant
    )
    identity = _identity(config, source.spec, dht, weight_bytes)
    layers = await _choose_layers(config, directory, source.spec, identity.max_layers)
    shared = SharedDevice.for_device(config.device, config.executor.shared_device)
    executor = Executor(config.executor, name=f"torch-{config.device}", shared=shared)
    peer = Peer(identity, source.spec, executor, config.sessions, read_live=directory.read_peers)
    announcer = Announcer(directory, peer.record)
    watch = SwarmWatch(directory, config.watch)
    watch.on_snapshot.append(lambda snapshot: peer.set_live_peers(snapshot.peers))
    links = LinkMonitor(
        p2p,
        peer.peer_id,
        _watched_peers(watch),
        config.links,
        on_change=peer.set_links,
        traffic=directory.traffic,
    )
    via: tuple[str, ...] | None = None
    try:
        async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tg:
            tg.create_task(executor.run())
            tg.create_task(shared.run())
            await _load_and_measure(config, source, peer, layers)
            handlers = PeerHandlers(
                peer, p2p, config.sessions, _faults(config, identity.name), on_probe=links.heard_probe
            )
            handlers.traffic = directory.traffic
            stack.push_async_callback(handlers.aclose)
            await serve(p2p, handlers)
            tg.create_task(announcer.run())
            tg.create_task(_announce_changes(directory, peer))
            tg.create_task(reap_idle_sessions(peer, config.sessions.reap_interval_s))
            tg.create_task(_log_batches(executor, handlers.forwarder, BATCH_LOG_INTERVAL_S))
            tg.create_task(watch.run())
            if config.traffic_file:
                tg.create_task(_write_traffic(Path(config.traffic_file), directory, watch))
            tg.create_task(links.run())
            if config.plan:  # the election runs always; the planner plans while we hold the lease
                election = Election(directory, config.election, swarm=_seen_by(watch))
                tg.create_task(election.run())
                planner = PlannerService(
                    directory, election, config.planner, _model_info(config, source.spec)
                )
                tg.create_task(planner.run())
            if config.follow_plan:
                follower = _follower(config, peer, directory, source, handlers.handover, watch)
                tg.create_task(follower.run())
            async with asyncio.timeout(60):
                await announcer.announced.wait()
            _report_serving(config, peer, began)
            peer.reachable = await _check_reachable(
                config, p2p, directory, peer.peer_id, dht.relays, identity
            )
            relays_lost = asyncio.Event()
            if dht.relays and peer.reachable:
                relays = watch_relays(
                    _live_ids(directory), dht.relays, config.reachability.relay_watch_interval_s
                )
                tg.create_task(_set_when_done(relays, relays_lost))
            await _first_set(stop, relays_lost)
            await _leave(peer, directory, config.shutdown_grace_s, handlers.handover)
            if relays_lost.is_set() and not stop.is_set():
                via = await _rejoin_via(directory, peer.peer_id)
            raise _Leave
    except* _Leave:
        pass
    return via


async def _log_batches(executor: Executor, forwarder: Forwarder, interval_s: float) -> None:
    """Log, for each busy interval, how many steps ran in how many forward calls: the mean batch the executor
    formed, and the share of the interval its forward calls took (scripts/bench_e2e.py reads both to check that
    concurrent sessions' decode steps do batch, and where a round's time goes); and the steps per message sent
    on to the next hops."""
    steps, batches, compute_s = executor.steps_run, executor.batches_run, executor.compute_s
    sent, messages = forwarder.steps, forwarder.messages
    since = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        if executor.batches_run > batches:
            new_steps, new_batches = executor.steps_run - steps, executor.batches_run - batches
            logger.info(
                "executor: %d steps in %d forward calls in the last %.0f s (mean batch %.2f, computing %.0f%%)"
                "; %d steps forwarded in %d messages",
                new_steps,
                new_batches,
                now - since,
                new_steps / new_batches,
                100 * (executor.compute_s - compute_s) / max(now - since, 1e-9),
                forwarder.steps - sent,
                forwarder.messages - messages,
            )
        steps, batches, compute_s, since = executor.steps_run, executor.batches_run, executor.compute_s, now
        sent, messages = forwarder.steps, forwarder.messages


def _model_info(config: PeerConfig, spec: ModelSpec) -> ModelInfo:
    """The planner's model, from our own spec: no announcement decides the swarm's shape."""
    activation_bytes = spec.hidden_size * DTYPE_BYTES[config.torch_dtype_name]
    return ModelInfo(name=spec.name, num_layers=spec.num_layers, activation_bytes_per_token=activation_bytes)


def _seen_by(watch: SwarmWatch) -> Callable[[], tuple[Collection[str], Mapping[str, LeaseRecord]] | None]:
    """The peer ids and leases of the watch's latest snapshot (None before its first), for the election."""

    def seen() -> tuple[Collection[str], Mapping[str, LeaseRecord]] | None:
        snapshot = watch.snapshot
        return None if snapshot is None else (snapshot.peers.keys(), snapshot.leases)

    return seen


def _watched_peers(watch: SwarmWatch) -> Callable[[], Awaitable[dict[str, PeerRecord]]]:
    """The link monitor's view of the swarm: the watch's latest snapshot (no read of its own)."""

    async def read() -> dict[str, PeerRecord]:
        return dict((await watch.latest()).peers)

    return read


async def _write_traffic(path: Path, directory: Directory, watch: SwarmWatch) -> None:
    """Write our background traffic by cause, with the reads the watch made, every TRAFFIC_WRITE_S."""
    while True:
        report = {
            "at": time.time(),
            "by_cause": directory.traffic.as_dict(),
            "summary_reads": watch.summary_reads,
            "full_reads": watch.full_reads,
            "thorough_reads": watch.thorough_reads,
            "confirmations": directory.confirmations,
            "stores": await _stored_keys(directory),
        }
        try:
            _write_atomic(path, json.dumps(report) + "\n")
        except OSError as e:  # a full disk or a removed directory must not stop the peer
            logger.warning("could not write %s: %r", path, e)
        await asyncio.sleep(TRAFFIC_WRITE_S)


async def _stored_keys(directory: Directory) -> list[str]:
    """Which of the model's keys this peer stores for others (none if the DHT does not answer)."""
    try:
        async with asyncio.timeout(TRAFFIC_WRITE_S):
            return await directory.dht.stored_keys(directory.key_names())
    except (TimeoutError, OSError, RuntimeError):
        return []


def _faults(config: PeerConfig, name: str) -> OutputFaults | None:
    if config.faulty_output_rate == 0 and config.faulty_skip_rate == 0:
        return None
    logger.warning(
        "TEST ONLY: corrupting %.0f%% of our outputs, skipping %.0f%% of our forwards",
        100 * config.faulty_output_rate,
        100 * config.faulty_skip_rate,
    )
    return OutputFaults(config.faulty_output_rate, seed_of(name), config.faulty_skip_rate)


def _identity(config: PeerConfig, spec: ModelSpec, dht: SwarmDHT, weight_bytes: int) -> Identity:
    """``weight_bytes``: one layer's weights as this device holds them (ModelSource.held_layer_bytes)."""
    budget = memory_budget_bytes(config.device, config.max_memory_gb)
    max_layers = max_layers_within(spec, config.torch_dtype_name, budget, config.cache_tokens, weight_bytes)
    if max_layers == 0:
        raise ValueError(
            f"a memory budget of {budget / 1024**3:.2f} GiB does not fit one layer of {spec.name} with "
            f"{config.cache_tokens} cache tokens: raise --max-memory-gb or lower --cache-tokens"
        )
    name = config.name or dht.peer_id[-6:]
    return Identity(dht.peer_id, name, tuple(dht.visible_maddrs()), budget, max_layers)


async def _load_and_measure(config: PeerConfig, source: ModelSource, peer: Peer, layers: LayerRange) -> None:
    spec, identity = source.spec, peer.identity
    logger.info(
        "loading layers %s of %s (%d layers fit in %.2f GiB)",
        layers,
        spec.name,
        identity.max_layers,
        identity.memory_bytes / 1024**3,
    )
    dtype = config.torch_dtype_name
    weight_bytes = source.held_layer_bytes(config.device, dtype, config.quant)
    spare = packing_bytes(spec, dtype, identity.memory_bytes, config.cache_tokens, len(layers), weight_bytes)
    blocks = await asyncio.to_thread(
        source.load_blocks,
        layers.start,
        layers.end,
        config.device,
        config.torch_dtype_name,
        config.cache_tokens,
        spare,
        config.quant,
    )
    logger.info("measuring compute speed of one layer")
    peer.compute = await peer.executor.call(lambda: measure_compute(blocks))
    logger.info(
        "measured per layer: decode %.0f tok/s (batch 1), %.0f tok/s (batch 8), prefill %.0f tok/s",
        peer.compute.decode_layer_tokens_s_b1,
        peer.compute.decode_layer_tokens_s_b8,
        peer.compute.prefill_layer_tokens_s,
    )
    peer.serve(blocks)
    freeze_loaded()  # a full collection over the loaded heap would stop every session here for ~0.5 s


def _report_serving(config: PeerConfig, peer: Peer, began: float) -> None:
    maddrs = peer.identity.maddrs
    logger.info("serving layers %s as %s after %.1f s", peer.held, peer.peer_id, time.monotonic() - began)
    if config.maddr_file:
        _write_atomic(Path(config.maddr_file), "\n".join(maddrs) + "\n")
    print("\n".join(["Peer is serving. Others join with:", *[f"  --initial-peers {m}" for m in maddrs]]))


async def _leave(peer: Peer, directory: Directory, grace_s: float, handover: Handovers) -> None:
    """Refuse new sessions, say so in the DHT, hand open sessions over to successors (swarm.peer.handover),
    let the rest finish within ``grace_s``; stay a moment for clients to learn where their sessions went."""
    logger.info("leaving: no new sessions; %d open ones get %.0f s", peer.session_count, grace_s)
    peer.stop_accepting()
    try:
        async with asyncio.timeout(5):
            await directory.announce(peer.record())
    except (TimeoutError, OSError, RuntimeError) as e:
        logger.warning("could not announce that we are leaving: %s", e)
    try:
        moved = await handover.hand_over_all(peer.ranges, await directory.read_peers())
        logger.info("handed %d sessions over", moved)
    except Exception as e:  # hand-over is an optimisation: the clients replay without it
        logger.warning("hand-over failed: %r", e)
    await peer.drain(grace_s)
    await handover.wait_told(min(grace_s, HANDOVER_LINGER_S))


def _follower(
    config: PeerConfig,
    peer: Peer,
    directory: Directory,
    source: ModelSource,
    handover: Handovers,
    watch: SwarmWatch,
) -> PlanFollower:
    async def announce() -> bool:
        return await directory.announce(peer.record())

    async def hand_over(served: Served) -> int:
        return await handover.hand_over_all([served], await directory.read_peers())

    return PlanFollower(
        peer=peer,
        directory=directory,
        source=source,
        announce=announce,
        config=config.follow,
        hand_over=hand_over,
        watch=watch,
    )


async def _announce_changes(directory: Directory, peer: Peer) -> None:
    """Announce as soon as the record changes in a way others should know (new range, new links)."""
    while True:
        await peer.changed.wait()
        peer.changed.clear()
        try:
            async with asyncio.timeout(10):
                await directory.announce(peer.record())
        except Exception as e:  # the periodic announcer carries the change if this one fails
            logger.debug("announce after a change failed: %r", e)


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


async def _reach_before_join(config: PeerConfig, dht_config: DHTConfig) -> DHTConfig:
    """Ask initial peers to dial us back before joining; when none can and relaying is allowed, join as a DHT
    client served through the relays of those that answered (swarm.peer.reach)."""
    if not needs_check(dht_config):
        return dht_config
    try:
        check = await check_before_join(dht_config, config.sessions.dial_back_timeout_s)
    except Exception as e:  # e.g. the port is taken: the DHT's own start reports that better
        logger.warning("could not check reachability before joining: %r", e)
        return dht_config
    logger.info("reachability before joining: %s", check.detail)
    if check.reachable is not False:
        return dht_config
    why_not = relaying_off_reason(config.reachability)
    if why_not:
        logger.warning("%s %s: %s (%s)", RELAY_FAILED, why_not, REACHABILITY_ADVICE, check.detail)
        return dht_config
    relay_ids = ", ".join(m.rsplit("/p2p/", 1)[1][-8:] for m in check.relays)
    logger.info("no one can dial us: joining through the relay of %s", relay_ids)
    return replace(dht_config, relays=check.relays, client_mode=True)


async def _check_reachable(
    config: PeerConfig,
    p2p: P2P,
    directory: Directory,
    own_id: str,
    relays: tuple[str, ...],
    identity: Identity,
) -> bool | None:
    """Ask another live peer to dial us back at our record's addresses; log the verdict. None when alone.
    Through relays, ask a few times: p2pd reserves its slots at them in the background."""
    timeout_s = config.sessions.dial_back_timeout_s
    attempts = RELAY_CHECK_ATTEMPTS if relays else 1
    for attempt in range(attempts):
        ok, detail = await check_after_join(p2p, directory, own_id, identity.maddrs, timeout_s)
        if ok is not False or attempt == attempts - 1:
            break
        await asyncio.sleep(RELAY_CHECK_PAUSE_S)
    relay_ids = ", ".join(m.rsplit("/p2p/", 1)[1][-8:] for m in relays)
    if ok is None:
        logger.info("reachability unknown: %s", detail)
    elif relays and ok:
        logger.info("%s %s: %s through it", RELAY_OK, relay_ids, detail)
    elif relays:
        logger.error(
            "%s %s (the relays %s may relay for no one: they run with --no-relay, or are full: "
            "--relay-max-reservations)",
            RELAY_FAILED,
            detail,
            relay_ids,
        )
    elif ok:
        logger.info("reachability: %s", detail)
    else:
        logger.warning("%s (%s)", REACHABILITY_ADVICE, detail)
    return ok


async def _rejoin_via(directory: Directory, own_id: str) -> tuple[str, ...]:
    """Live peers others can dial, to rejoin through once every relay we were served through left."""
    try:
        via = relay_candidates(await directory.read_peers(), own_id)
    except (TimeoutError, OSError, RuntimeError) as e:
        logger.error("%s every relay left, and reading the swarm for others failed: %r", RELAY_FAILED, e)
        return ()
    if not via:
        logger.error("%s every relay left, and no live peer that others can dial is left", RELAY_FAILED)
    return via


async def _set_when_done(work: Awaitable[None], done: asyncio.Event) -> None:
    await work
    done.set()


async def _first_set(*events: asyncio.Event) -> None:
    """Return once any of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _live_ids(directory: Directory) -> Callable[[], Awaitable[Collection[str]]]:
    async def read() -> Collection[str]:
        return (await directory.read_peers()).keys()

    return read


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
