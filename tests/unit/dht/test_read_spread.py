"""SwarmDHT.read_near's choice of node: each reader starts at its own place in a key's nodes, then moves on."""

from __future__ import annotations

from swarm.dht.node import SwarmDHT


def reader(peer_id: str) -> SwarmDHT:
    dht = object.__new__(SwarmDHT)  # no DHT process: only the choice of node is tested
    dht.peer_id, dht._reads = peer_id, {}
    return dht


def test_each_read_moves_on_by_the_nodes_it_asked() -> None:
    a = reader("QmA")
    first = a._next_reads("k", 1)
    assert a._next_reads("k", 1) == first + 1
    assert a._next_reads("k", 3) == first + 2
    assert a._next_reads("k", 1) == first + 5


def test_readers_start_at_different_nodes() -> None:
    starts = {reader(f"Qm{i}")._next_reads("k", 1) % 5 for i in range(40)}
    assert len(starts) == 5  # 40 readers of a key stored at 5 nodes: every node is someone's first
