"""Reads that must not lose what the DHT holds: a read made again from more nodes keeps their answers (and the
watch reads once more while a member the planner saw is still missing); a hostile node's malformed answer
counts as no answer; a storing node that stopped answering is asked no more."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from swarm.dht.directory import membership_digest
from swarm.dht.node import _read_at
from swarm.dht.schemas import SummaryRecord, record_key
from swarm.dht.watch import SwarmWatch, WatchConfig
from tests.unit.dht.records import MODEL_HASH, peer_record
from tests.unit.dht.test_trust import NOW, keys, read, swarm  # noqa: F401  (keys is a fixture)

pytestmark = pytest.mark.timeout(60)


# --- Directory._read(thorough=True): the answer of three nodes ------------------


def test_a_thorough_read_keeps_what_the_extra_nodes_had(keys: list[Any]) -> None:  # noqa: F811
    dht, directory = swarm(keys)
    read(directory)  # every key read once: all are "seen" now
    joiner = keys[3]
    key = record_key(MODEL_HASH, joiner.peer_id)
    record = peer_record(joiner.peer_id, 0, 8, updated_at=NOW).to_dht()
    asks: list[int] = []

    async def store_reached_some_nodes(keys_: Any, ask: int = 1) -> dict[str, dict[bytes, Any]]:
        # The joiner's store reached some of the key's nodes: one node asked lacks it, three asked have it.
        asks.append(ask)
        found = {k: await dht.get(k) for k in keys_}
        if ask > 1 and key in found:
            found[key] = {**found[key], joiner.subkey: (record, NOW + 30)}
        return found

    dht.read_near = store_reached_some_nodes  # type: ignore[method-assign]
    snapshot = asyncio.run(directory.snapshot(thorough=True))
    assert 3 in asks  # the 3-node read was made ...
    assert joiner.peer_id in snapshot.peers  # ... and its answer kept


# --- a hostile node's DictionaryDHTValue with a malformed maxsize -----------------------------------


def hostile_dictionary() -> DictionaryDHTValue:
    value = DictionaryDHTValue()
    value.maxsize = "x"  # type: ignore[assignment]  # a hostile node packs any msgpack here
    return MSGPackSerializer.loads(MSGPackSerializer.dumps(value))  # as call_find unpacks it off the wire


class HostileProtocol:
    serializer = MSGPackSerializer
    record_validator = None

    def __init__(self) -> None:
        self.storage = DHTLocalStorage()

    async def call_find(self, peer: Any, key_ids: Any) -> dict[Any, Any]:
        return {k: (ValueWithExpiration(hostile_dictionary(), get_dht_time() + 30), {}) for k in key_ids}


class HostileNode:
    protocol = HostileProtocol()


def test_a_hostile_nodes_malformed_answer_counts_as_no_answer() -> None:
    keys_ = ("m_peers", "m_lease")
    known = {k: (b"hostile-node", b"honest-node") for k in keys_}
    values, _, failed, _ = asyncio.run(
        _read_at(None, HostileNode(), keys=keys_, known=known, starts={k: 0 for k in keys_}, ask=1)  # type: ignore[arg-type]
    )
    assert values == {k: {} for k in keys_} and not failed  # it answered, with nothing usable


# --- a storing node that stopped answering ----------


class DeadNodeProtocol:
    serializer = MSGPackSerializer
    record_validator = None

    def __init__(self) -> None:
        self.storage = DHTLocalStorage()
        self.asked: list[bytes] = []

    async def call_find(self, peer: Any, key_ids: Any) -> dict[Any, Any] | None:
        self.asked.append(peer.to_bytes())
        if peer.to_bytes() == b"dead":
            await asyncio.sleep(0.05)  # hivemind's wait_timeout (3 s), shortened
            return None
        return {k: (None, {}) for k in key_ids}


class FakeNode:
    def __init__(self) -> None:
        self.protocol = DeadNodeProtocol()


class FakeHivemind:
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    async def run_coroutine(self, fn: Any, return_future: bool = True) -> Any:
        return await fn(None, self.node)


def test_a_storing_node_that_stopped_answering_is_asked_no_more() -> None:
    import time

    from swarm.dht.node import SwarmDHT

    node = FakeNode()
    dht = object.__new__(SwarmDHT)
    dht.peer_id, dht._reads, dht._dht = "QmReader", {}, FakeHivemind(node)
    key = "m_peers3"
    start = dht._next_reads(key, 0) % 5  # where this reader's reads start (ask=0: the counter stays)
    nodes = [b"n1", b"n2", b"n3", b"n4"]
    nodes.insert(start, b"dead")
    dht._replicas = {key: (tuple(nodes), time.monotonic())}

    async def reads() -> None:
        for _ in range(10):
            await dht.read_near([key])

    asyncio.run(reads())
    dead_asks = node.protocol.asked.count(b"dead")
    assert dead_asks == 1, f"the dead node was asked {dead_asks} times in 10 reads (each a full RPC timeout)"


# --- the watch and a join whose record the one-node reads lack -------------------


def test_the_watch_sees_a_join_whose_record_only_some_nodes_have(keys: list[Any]) -> None:  # noqa: F811
    from swarm.dht.schemas import PeerRecord, summary_key

    dht, directory = swarm(keys)
    b, joiner = keys[2], keys[3]
    watch = SwarmWatch(directory, WatchConfig(poll_s=1.0, fallback_s=5.0))

    def summary(peers: dict[str, Any], created_at: float) -> dict[str, Any]:
        return SummaryRecord(
            planner_peer_id=b.peer_id,
            plan_epoch=3,
            peers_digest=membership_digest(peers),
            peer_count=len(peers),
            created_at=created_at,
        ).to_dht()

    async def body() -> None:
        await watch.tick()  # first full read: b holds the lease
        known = dict(watch.snapshot.peers)  # type: ignore[union-attr]
        dht.put(summary_key(MODEL_HASH), b.subkey, summary(known, NOW - 1))
        await watch.tick()
        key = record_key(MODEL_HASH, joiner.peer_id)
        record = peer_record(joiner.peer_id, 0, 8, updated_at=NOW)
        real_read = dht.read_near

        async def store_reached_some_nodes(keys_: Any, ask: int = 1) -> Any:
            found = await real_read(keys_, ask)
            if ask > 1 and key in found:  # 3 nodes asked: one of them has it
                found[key] = {**found[key], joiner.subkey: (record.to_dht(), NOW + 30)}
            return found

        dht.read_near = store_reached_some_nodes  # type: ignore[method-assign]
        with_joiner: dict[str, PeerRecord] = {**known, joiner.peer_id: record}
        dht.put(summary_key(MODEL_HASH), b.subkey, summary(with_joiner, NOW))  # the planner saw the join
        for _ in range(10):
            await watch.tick()
        assert watch.thorough_reads >= 1
        assert joiner.peer_id in watch.snapshot.peers, (  # type: ignore[union-attr]
            f"10 polls after the summary, the join is still unseen ({watch.full_reads} full reads, "
            f"{watch.thorough_reads} thorough)"
        )

    asyncio.run(body())
