"""SwarmDHT: the hivemind DHT of one peer or client, with signed, schema-checked FlowSwarm records.

hivemind.DHT runs its node (and its p2pd daemon) in a child process; calls go through a pipe and come back as
MPFutures, which we await. hivemind's P2P turns on UPnP/NAT-PMP port mapping and AutoNAT by default, which send
traffic towards the gateway and the public internet: we pass both explicitly, OFF unless a home user opts in
through ReachabilityConfig. Circuit relays stay on, bounded (ReachabilityConfig.daemon_flags).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from swarm.dht.identity import ensure_identity_file, load_private_key, peer_id_of_public_key
from swarm.dht.process import ParentBoundDHT
from swarm.dht.schemas import FlowSwarmSchema, model_key
from swarm.errors import TransportError
from swarm.settings import positive, setting

logger = logging.getLogger(__name__)

# Go threads (GOMAXPROCS) of the p2pd daemon each process starts. With Go's default (a thread per core) a
# message's goroutines hop between threads that spin before they park: on this 2-core machine a 2.6 KB frame and
# its echo on an open stream cost both daemons 350-440 us of CPU, and 260 us with one thread, in as much time.
P2PD_THREADS = 1
REPLICAS_REFRESH_S = (
    120.0  # how long the nodes found for a key are stored to before they are looked for again
)
FEW_REPLICAS_REFRESH_S = 15.0  # the same, when fewer than FULL_REPLICAS were found (the swarm is growing)
FULL_REPLICAS = 5  # nodes a key is stored at in a swarm large enough (hivemind's num_replicas)

# How a peer's log line on its relay starts: it serves through one (and was dialled back through it), or it
# cannot, followed by exactly why (swarm.peer.reach; tests and benchmarks look for these).
RELAY_OK = "serving through relay"
RELAY_FAILED = "cannot serve through a relay:"


@dataclass(frozen=True)
class ReachabilityConfig:
    """Reachability behind a NAT. Circuit relaying is on: a reachable peer relays, within the bounds below, for
    peers that cannot accept connections, and a peer that finds at join that no one can dial it serves through
    such a relay (swarm.peer.reach). UPnP / NAT-PMP and AutoNAT stay opt-in: they send traffic to the gateway."""

    use_relay: bool = setting(
        True,
        "never use circuit relays: neither dial peers behind NAT through them, nor relay for them",
        flag="no-relay",
    )
    relay_when_unreachable: bool = setting(
        True,
        "when no peer can dial us at join, do not serve through another peer's relay (just say why)",
        flag="no-relay-when-unreachable",
    )
    relay_max_reservations: int = setting(32, "most peers behind NAT we relay for at once")
    relay_max_circuits: int = setting(16, "most relayed connections at once to or from one peer")
    relay_data_limit_bytes: int = setting(
        1024**3, "bytes one relayed connection may carry each way before we reset it"
    )
    relay_time_limit_s: float = setting(3600.0, "longest a relayed connection may last before we reset it")
    relay_watch_interval_s: float = setting(
        15.0, "how often a peer served through relays looks whether they are still in the swarm"
    )
    nat_port_map: bool = setting(False, "ask the router for a port mapping (UPnP / NAT-PMP)")
    auto_nat: bool = setting(False, "run the AutoNAT service: ask others whether we are reachable")
    announce_maddrs: tuple[str, ...] = setting(
        (),
        "public multiaddrs to announce instead of the listening ones",
        flag="--announce-maddr",
        metavar="MADDR",
    )

    def __post_init__(self) -> None:
        positive(self, "relay_max_reservations", "relay_max_circuits", "relay_data_limit_bytes")
        positive(self, "relay_time_limit_s", "relay_watch_interval_s")

    def p2p_kwargs(self, relays: tuple[str, ...] = ()) -> dict[str, Any]:
        """hivemind P2P.create's options. ``relays``: multiaddrs of the peers we serve through (we cannot be
        dialled): we reserve a slot at each of them and relay for no one."""
        if relays and not self.use_relay:
            raise ValueError("serving through relays needs use_relay")
        kwargs: dict[str, Any] = {
            "use_relay": self.use_relay,
            "use_auto_relay": bool(relays),  # reservations at the given relays only (see daemon_flags)
            "nat_port_map": self.nat_port_map,
            "auto_nat": self.auto_nat,
            "use_ipfs": False,  # never bootstrap from the public IPFS network
        }
        if relays:  # our reachability is known: start the relay client at once, AutoNAT is not asked
            kwargs["force_reachability"] = "private"
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.announce_maddrs)
        return kwargs

    def daemon_flags(self, relays: tuple[str, ...] = (), relay_service: bool = True) -> dict[str, str]:
        """p2pd flags that hivemind's P2P.create has no option for (swarm.dht.process appends them).

        With ``relays``, the static-relay mode: p2pd's relay discovery would wait for four candidates or three
        minutes before its first reservation. ``relay_service``: relay for others within our bounds (a client,
        or a peer that is itself behind NAT, does not)."""
        if not self.use_relay:
            return {}
        if relays:
            return {"trustedRelays": ",".join(relays), "relayDiscovery": "0", "relayService": "0"}
        if not relay_service:
            return {"relayService": "0"}
        return {
            "relayService": "1",
            "relayMaxReservations": str(self.relay_max_reservations),
            "relayMaxCircuits": str(self.relay_max_circuits),
            "relayDataLimit": str(self.relay_data_limit_bytes),
            "relayTimeLimit": f"{self.relay_time_limit_s:g}s",
        }


@dataclass(frozen=True)
class DHTConfig:
    """Where and how this process joins the swarm's DHT."""

    initial_peers: tuple[str, ...] = ()  # multiaddrs of running peers; empty starts a new swarm
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # 0 picks a free port
    identity_path: str | None = None  # persistent libp2p identity (RSA key); None = fresh, temporary one
    client_mode: bool = False  # a client asks the DHT but stores nothing for others and is not dialled
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    relays: tuple[
        str, ...
    ] = ()  # serve through these peers' circuit relays (we cannot be dialled); see p2p_kwargs
    listen: bool = True  # False listens on no address: no one can dial us (a NAT without inbound, for tests)
    start_timeout_s: float = 60.0  # bootstrap deadline
    request_timeout_s: float = 3.0  # hivemind's wait_timeout for one DHT RPC
    p2pd_threads: int = P2PD_THREADS  # the daemon's GOMAXPROCS; 0 leaves Go's default (or the environment's)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range 0..65535")
        if self.p2pd_threads < 0:
            raise ValueError(f"p2pd_threads must be >= 0, got {self.p2pd_threads}")
        if self.relays and not self.client_mode:
            raise ValueError("a node served through relays cannot answer DHT requests: set client_mode")


class SwarmDHT:
    """A running hivemind DHT node for one model. Create with `SwarmDHT.create(...)`, end with `shutdown()`."""

    def __init__(
        self,
        dht: hivemind.DHT,
        model_hash: str,
        identity_path: Path,
        temporary_identity: bool,
        relays: tuple[str, ...] = (),
    ) -> None:
        self._dht = dht
        self.relays = relays  # the relays we serve through (multiaddrs ending in /p2p/<relay id>)
        self.model_hash = model_hash
        self._identity_path = identity_path
        self._temporary_identity = temporary_identity
        self._private_key = load_private_key(identity_path)
        self._replicas: dict[str, tuple[tuple[bytes, ...], float]] = {}  # key -> (its nodes, when found)
        self._reads: dict[str, int] = {}  # key -> where our next read of it starts in its nodes (read_near)
        self.public_key_marker: bytes = RSASignatureValidator(self._private_key).local_public_key
        self.peer_id: str = dht.peer_id.to_base58()
        # The signing key is the libp2p identity, so the id a reader derives from it must be ours.
        signer_id = peer_id_of_public_key(self._private_key.get_public_key())
        if signer_id != self.peer_id:
            raise RuntimeError(f"signing key hashes to {signer_id}, but the libp2p peer id is {self.peer_id}")

    @classmethod
    async def create(cls, config: DHTConfig, model_hash: str) -> SwarmDHT:
        """Start the DHT child process and join the swarm, waiting on a worker thread (the loop keeps running).

        Cancelling this waits for the bootstrap thread to end (within config.start_timeout_s), then stops the
        DHT it started: a thread cannot be interrupted, and nothing may be left running.
        """
        # Key generation and reading are CPU and disk work: off the loop too.
        identity_path, temporary = await asyncio.to_thread(ensure_identity_file, config.identity_path)
        dht: hivemind.DHT | None = None
        try:
            # Forking the child takes milliseconds; it is done here so that it never forks from a worker thread.
            dht = _start_dht(config, model_hash, identity_path, temporary)
            joining = asyncio.ensure_future(
                asyncio.to_thread(cls._join, dht, config, model_hash, identity_path, temporary)
            )
            try:
                self = await asyncio.shield(joining)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await joining
                raise
        except BaseException:
            if dht is not None:
                await asyncio.shield(asyncio.to_thread(dht.shutdown))
            if temporary:
                identity_path.unlink(missing_ok=True)
            raise
        if temporary:  # p2pd and the signer hold the key now: a process killed later leaves no key behind
            identity_path.unlink(missing_ok=True)
        logger.info("joined the DHT as %s (client_mode=%s)", self.peer_id, config.client_mode)
        return self

    @classmethod
    def _join(
        cls, dht: hivemind.DHT, config: DHTConfig, model_hash: str, identity_path: Path, temporary: bool
    ) -> SwarmDHT:
        """Blocking: wait until the child has joined, then ask it for its peer id (a pipe round trip)."""
        try:
            dht.wait_until_ready(timeout=config.start_timeout_s)
        except Exception as e:
            where = f"via {', '.join(config.initial_peers)}" if config.initial_peers else "as the first node"
            raise TransportError(f"could not join the DHT {where}: {type(e).__name__}: {e}") from e
        return cls(dht, model_hash, identity_path, temporary, config.relays)

    @property
    def hivemind_dht(self) -> hivemind.DHT:
        return self._dht

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs others can dial, each ending in /p2p/<peer id>: pass them as initial_peers. Served through
        relays, the circuit addresses through each of them; listening nowhere and not relayed, none."""
        if self.relays:
            return [circuit_maddr(relay, self.peer_id) for relay in self.relays]
        try:
            return [str(m) for m in self._dht.get_visible_maddrs()]
        except ValueError:  # hivemind raises when the daemon listens nowhere
            return []

    async def replicate_p2p(self) -> P2P:
        """The hivemind P2P of this node's daemon, for RPC handlers and callers (lives while the DHT does)."""
        return await self._dht.replicate_p2p()

    async def store(self, key: str, subkey: bytes, value: dict[str, Any], expiration_time: float) -> bool:
        """Store value under our own signed subkey; True if at least one node accepted it.

        Straight to the nodes that store the key, as found at most REPLICAS_REFRESH_S ago: hivemind's own store
        first searches for them, and every node on the way answers with the whole value it holds under the key
        (every peer's record, for the peers key), so a store would cost as much as a full read."""
        if self.public_key_marker not in subkey:
            raise ValueError("a FlowSwarm subkey must carry this node's owner marker (see own_subkey)")
        known, found_at = self._replicas.get(key, ((), float("-inf")))
        fresh = time.monotonic() - found_at < _replicas_refresh_s(known)
        store = partial(
            _store_at,
            key=key,
            subkey=subkey,
            value=value,
            expiration=expiration_time,
            targets=known if fresh else (),
        )
        stored, targets = await self._dht.run_coroutine(store, return_future=True)
        if targets and stored * 2 >= len(targets):
            self._replicas[key] = (targets, found_at if fresh else time.monotonic())
        else:  # most of them did not take it: look for the key's nodes again next time
            self._replicas.pop(key, None)
        if stored == 0:  # alone, or nobody answered: hivemind's own search and store (ours too, if nearest)
            future = self._dht.store(key, value, expiration_time, subkey=subkey, return_future=True)
            return bool(await future)
        return True

    async def get(self, key: str, latest: bool = True) -> dict[bytes, tuple[Any, float]]:
        """All live subkeys of key as {subkey: (value, expiration)}; {} when the key is unknown."""
        found = await self._dht.get(key, latest=latest, return_future=True)
        return _live_items(found)

    async def read_near(self, keys: Sequence[str], ask: int = 1) -> dict[str, dict[bytes, tuple[Any, float]]]:
        """The live subkeys of each of ``keys``, read straight from the nodes that store it (found at most
        REPLICAS_REFRESH_S ago, the ones our stores go to), with what we store ourselves merged in.

        Each read asks ``ask`` of a key's nodes, the next ones in turn (starting where our id points), so the
        reads of all peers spread evenly over every node storing the key rather than all landing on the
        nearest; keys asked of the same node share one request. A node that does not answer is replaced by the
        next in the same read. A key with no nodes found (a swarm of one) reads our own storage only."""
        if ask < 1:
            raise ValueError(f"ask must be >= 1, got {ask}")
        keys = tuple(dict.fromkeys(keys))
        now = time.monotonic()
        known = {}
        for key in keys:
            targets, found_at = self._replicas.get(key, ((), float("-inf")))
            known[key] = targets if now - found_at < _replicas_refresh_s(targets) else ()
        starts = {key: self._next_reads(key, ask) for key in keys}
        read = partial(_read_at, keys=keys, known=known, starts=starts, ask=ask)
        values, targets, failed, silent = await self._dht.run_coroutine(read, return_future=True)
        for key in keys:
            alive = tuple(t for t in targets.get(key, ()) if t not in silent)
            if key in failed or not alive:
                self._replicas.pop(key, None)  # look for its nodes again next time
            elif not known[key] or len(alive) < len(known[key]):
                # a node that did not answer is asked no more (it left, or hangs): hivemind's routing table
                # drops such a node at once too
                self._replicas[key] = (alive, now if not known[key] else self._replicas[key][1])
        return values

    async def get_near(self, key: str, ask: int = 1) -> dict[bytes, tuple[Any, float]]:
        """`read_near` of one key."""
        return (await self.read_near((key,), ask))[key]

    def _next_reads(self, key: str, ask: int) -> int:
        """Where in ``key``'s list of nodes our next read starts (different for each reader, then in turn)."""
        if key not in self._reads:
            self._reads[key] = int.from_bytes(hashlib.sha256(f"{self.peer_id}/{key}".encode()).digest()[:4])
        start = self._reads[key]
        self._reads[key] = start + ask
        return start

    async def stored_keys(self, keys: tuple[str, ...]) -> list[str]:
        """Which of ``keys`` this node stores a value of for others (for benchmarks and status)."""
        return await self._dht.run_coroutine(partial(_stored_at, keys=keys), return_future=True)

    def own_subkey(self) -> bytes:
        """The subkey that only this node can write (its owner marker)."""
        return self.public_key_marker

    @staticmethod
    def now() -> float:
        """DHT time (unix seconds), the clock expirations are compared against."""
        return float(get_dht_time())

    def shutdown(self) -> None:
        """Stop the DHT child and its p2pd daemon; safe to call twice. Blocks for up to hivemind's
        shutdown_timeout: from async code prefer `await aclose()`; this stays for sync `finally` blocks."""
        started = time.monotonic()
        try:
            self._dht.shutdown()
        finally:
            if self._temporary_identity:
                self._identity_path.unlink(missing_ok=True)
        logger.debug("DHT shut down in %.1f s", time.monotonic() - started)

    async def aclose(self) -> None:
        """`shutdown()` on a worker thread; shielded, so a cancelled caller still leaves nothing running."""
        await asyncio.shield(asyncio.to_thread(self.shutdown))

    async def __aenter__(self) -> SwarmDHT:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
        return None


def _replicas_refresh_s(nodes: tuple[bytes, ...]) -> float:
    """How long the nodes found for a key are used: a short while if fewer than a full set were found, since
    nodes joining the swarm then become the key's nodes too."""
    return REPLICAS_REFRESH_S if len(nodes) >= FULL_REPLICAS else FEW_REPLICAS_REFRESH_S


def _live_items(found: Any) -> dict[bytes, tuple[Any, float]]:
    """A dictionary value's live subkeys as {subkey: (value, expiration)}; {} for none or a plain value."""
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    return {
        subkey: (item.value, item.expiration_time)
        for subkey, item in found.value.items()
        if item.expiration_time > now
    }


async def _nearest_nodes(node: DHTNode, keys: Sequence[str]) -> dict[str, tuple[bytes, ...]]:
    """The nodes (peer ids) nearest to each key, ours excluded, nearest first. Searched for sibling ids (each
    key's id with its last bit flipped): the same nearest nodes, but none holds a value under them, so the
    search moves neighbour lists, not the keys' values."""
    if not keys:
        return {}
    siblings = {key: DHTID(int(DHTID.generate(source=key)) ^ 1) for key in keys}
    nearest = await node.find_nearest_nodes(
        list(siblings.values()), k_nearest=node.num_replicas, exclude_self=True
    )
    return {
        key: tuple(peer.to_bytes() for peer in nearest[sibling].values()) for key, sibling in siblings.items()
    }


async def _read_at(
    _dht: hivemind.DHT,
    node: DHTNode,
    *,
    keys: tuple[str, ...],
    known: dict[str, tuple[bytes, ...]],
    starts: dict[str, int],
    ask: int,
) -> tuple[dict[str, dict[Any, tuple[Any, float]]], dict[str, tuple[bytes, ...]], set[str], set[bytes]]:
    """Runs in the DHT child (see SwarmDHT.read_near). Returns each key's live subkeys, the nodes found for
    each key, the keys none of whose nodes answered, and the nodes that did not answer."""
    targets = dict(known)
    targets.update(await _nearest_nodes(node, [key for key in keys if not known[key]]))
    key_ids = {key: DHTID.generate(source=key) for key in keys}
    merged: dict[str, DictionaryDHTValue] = {key: DictionaryDHTValue() for key in keys}
    for key in keys:
        local = node.protocol.storage.get(key_ids[key])
        if local is not None and isinstance(local.value, DictionaryDHTValue):
            _merge(merged[key], local.value)
    # Each key's nodes in the order this read tries them; the first ``ask`` at once, then one more for each
    # that did not answer.
    order = {
        key: [ts[(starts[key] + i) % len(ts)] for i in range(len(ts))] for key, ts in targets.items() if ts
    }
    pending = {key: nodes[:ask] for key, nodes in order.items()}
    tried = {key: len(nodes) for key, nodes in pending.items()}
    answered: set[str] = set()
    silent: set[bytes] = set()
    while pending:
        by_node: dict[bytes, list[str]] = {}
        for key, nodes in pending.items():
            for peer in nodes:
                by_node.setdefault(peer, []).append(key)
        answers = await asyncio.gather(
            *(node.protocol.call_find(PeerID(peer), [key_ids[k] for k in ks]) for peer, ks in by_node.items())
        )
        pending = {}
        for peer, ks, answer in zip(by_node, by_node.values(), answers, strict=True):
            if answer is None:
                silent.add(peer)
            for key in ks:
                if answer is None:  # no answer: ask the key's next node, if any is left
                    if tried[key] < len(order[key]):
                        pending.setdefault(key, []).append(order[key][tried[key]])
                        tried[key] += 1
                    continue
                answered.add(key)
                found, _neighbours = answer.get(key_ids[key], (None, {}))
                if found is not None and isinstance(found.value, DictionaryDHTValue):
                    _merge(merged[key], found.value)
    failed = {key for key in order if key not in answered}
    return {key: _plain(node, key_ids[key], merged[key]) for key in keys}, targets, failed, silent


def _merge(into: DictionaryDHTValue, other: DictionaryDHTValue) -> bool:
    """Each subkey of ``other`` into ``into``, the later expiration winning; False (and nothing merged) where
    ``other``, a node's answer, is malformed (its entries are checked by the validator, its fields are not)."""
    try:
        entries = [(subkey, entry.value, float(entry.expiration_time)) for subkey, entry in other.items()]
        for subkey, value, expiration in entries:
            into.store(subkey, value, expiration)
    except Exception:  # a hostile node's bytes: not an answer
        return False
    return True


def _plain(node: DHTNode, key_id: DHTID, value: DictionaryDHTValue) -> dict[Any, tuple[Any, float]]:
    """A dictionary value's live subkeys as {subkey: (value, expiration)}, signatures stripped."""
    serializer, validator, now = node.protocol.serializer, node.protocol.record_validator, get_dht_time()
    plain = {}
    for subkey, (value_bytes, expiration) in value.items():
        if expiration <= now:
            continue
        if validator is not None:
            record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes, expiration)
            value_bytes = validator.strip_value(record)
        plain[subkey] = (serializer.loads(value_bytes), expiration)
    return plain


async def _stored_at(_dht: hivemind.DHT, node: DHTNode, *, keys: tuple[str, ...]) -> list[str]:
    """Runs in the DHT child: which of ``keys`` its local storage holds."""
    return [key for key in keys if node.protocol.storage.get(DHTID.generate(source=key)) is not None]


async def _store_at(
    _dht: hivemind.DHT,
    node: DHTNode,
    *,
    key: str,
    subkey: bytes,
    value: Any,
    expiration: float,
    targets: tuple[bytes, ...],
) -> tuple[int, tuple[bytes, ...]]:
    """Runs in the DHT child: sign ``value`` and store it at ``targets`` (peer ids), or, with none, at the
    key's nearest nodes found first. Returns (how many stored it, the nodes asked)."""
    key_id = DHTID.generate(source=key)
    if not targets:
        targets = (await _nearest_nodes(node, [key]))[key]
    serializer = node.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    signed = record.value
    if node.protocol.record_validator is not None:
        signed = node.protocol.record_validator.sign_value(record)
    calls = [
        node.protocol.call_store(PeerID(target), [key_id], [signed], [expiration], [subkey])
        for target in targets
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    # Each answer is the node's list of store_ok flags (a protobuf sequence); None if it did not answer.
    stored = sum(
        1 for r in results if r is not None and not isinstance(r, BaseException) and len(r) and all(r)
    )
    return stored, targets


def _start_dht(config: DHTConfig, model_hash: str, identity_path: Path, temporary: bool) -> hivemind.DHT:
    """Fork the hivemind DHT child with signed, schema-checked records; it bootstraps in the background."""
    validators = [
        RSASignatureValidator(load_private_key(identity_path)),
        # Unknown keys are allowed: one DHT may host other models whose schemas this node lacks.
        SchemaValidator(FlowSwarmSchema, allow_extra_keys=True, prefix=model_key(model_hash)),
    ]
    ip = "ip6" if ":" in config.host else "ip4"
    reach = config.reachability
    listen = (
        {"host_maddrs": [f"/{ip}/{config.host}/tcp/{config.port}"]} if config.listen else {"no_listen": True}
    )
    return ParentBoundDHT(
        initial_peers=list(config.initial_peers) or None,
        start=True,
        await_ready=False,
        record_validators=validators,
        client_mode=config.client_mode,
        identity_path=str(identity_path),
        check_if_identity_free=not temporary,  # a fresh key cannot be taken; skip the probe
        wait_timeout=config.request_timeout_s,
        p2pd_threads=config.p2pd_threads,
        p2pd_flags=reach.daemon_flags(config.relays, relay_service=not config.client_mode),
        # No copies of what we read pushed to other nodes, no re-reads of our cache before it expires: a read
        # of the peers key would push every record to one more node, and re-read them all unasked.
        cache_nearest=0,
        cache_refresh_before_expiry=0,
        **listen,
        **reach.p2p_kwargs(config.relays),
    )


def circuit_maddr(relay_maddr: str, peer_id: str) -> str:
    """Where ``peer_id`` is reached through the relay at ``relay_maddr`` (which ends in /p2p/<relay id>)."""
    if "/p2p/" not in relay_maddr:
        raise ValueError(f"a relay's multiaddr must end in /p2p/<its peer id>: {relay_maddr}")
    return f"{relay_maddr}/p2p-circuit/p2p/{peer_id}"
