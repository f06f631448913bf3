"""A paper model of one idle peer's background traffic as the swarm grows.

Every byte one peer sends another receives, so the mean bytes a peer sends per second is the bytes moved per
second by all of the swarm's background work, divided by the number of peers: each peer's own work (its
summary polls, announcements, pings) in full, plus its share of the planner's and the candidates' work. Each
piece of work is counted as the DHT or RPC messages it takes, each message as its payload plus a fixed framing
cost (`Sizes.message_bytes`: libp2p stream set-up, noise and yamux frames, TCP/IP headers and ACKs).

A Kademlia search asks `beam` nodes per round and takes one round more per factor of `bucket` in swarm
size past the first bucket; every answer carries the answering node's `bucket` nearest neighbours.

The model is pure: the record sizes come from the caller (scripts/bench_dht.py measures them from real
records), and its output at the measured swarm sizes is printed beside the measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """Bytes of what moves (measured from real records, or defaults of their order)."""

    peer_record_bytes: int = 1100  # a peer record's payload, k links (msgpack)
    summary_bytes: int = 150  # the planner's summary
    lease_bytes: int = 140  # a lease record
    plan_bytes_per_peer: int = 120  # a plan's placement and flows, per peer
    signed_entry_bytes: int = 744  # a DHT entry's owner subkey (RSA public key) and signature
    neighbour_bytes: int = 58  # one neighbour in a search answer (DHT id, peer id)
    find_request_bytes: int = 90  # a search request's payload (key ids, the asker's node info)
    store_answer_bytes: int = 60  # a store's answer
    ping_bytes: int = 40  # an empty link probe's payload, each way
    message_bytes: int = 250  # framing of one message (see the module doc)


@dataclass(frozen=True)
class Rates:
    """How often things happen (the peer's defaults)."""

    summary_poll_s: float = 5.0  # WatchConfig.poll_s
    announce_s: float = 10.0  # DirectoryConfig.ttl_s / 3
    replicas_refresh_s: float = 120.0  # swarm.dht.node.REPLICAS_REFRESH_S
    link_refresh_s: float = 30.0  # LinkConfig.refresh_s
    pinged_peers: int = 6  # LinkConfig.nearest + sample
    pings: int = 3  # ProbeSizes.pings
    bandwidth_refresh_s: float = 3600.0  # LinkConfig.bandwidth_refresh_s
    bandwidth_probe_bytes: int = 600_000  # both directions of one link's bandwidth probe (sized for the link)
    nearest: int = 4  # LinkConfig.nearest: links whose bandwidth is probed
    lease_s: float = 10.0  # ElectionConfig.refresh_s: a candidate reads and writes the lease key
    candidates: int = 3  # ElectionConfig.max_candidates
    planner_check_s: float = 5.0  # PlannerConfig.check_interval_s: the planner reads every record
    summary_write_s: float = 10.0  # the planner refreshes its summary (summary_ttl_s / 3)
    replicas: int = 5  # nodes a DHT entry is stored at (hivemind's num_replicas)
    beam: int = 2  # nodes a summary read asks per round (swarm.dht.node.NEAR_BEAM)
    full_read_beam: int = 3  # nodes a read of every record asks per round (directory.FULL_READ_BEAM)
    bucket: int = 20  # hivemind's bucket size
    churn_per_s: float = 0.0  # joins, leaves and moves per second (each makes every peer read every record)


def search_calls(n: int, beam: int, bucket: int) -> int:
    """Nodes a search asks in a swarm of ``n``: ``beam`` per round, one more round per factor of ``bucket``."""
    if n <= 1:
        return 0
    rounds = 1 + max(0, math.ceil(math.log(max(n / bucket, 1.0), bucket)))
    return min(n - 1, beam * rounds)


def model_bytes_s(n: int, sizes: Sizes | None = None, rates: Rates | None = None) -> dict[str, float]:
    """Bytes per second one idle peer of a swarm of ``n`` sends (= receives), by cause, and "total"."""
    s, r = sizes or Sizes(), rates or Rates()
    msg = s.message_bytes
    neighbours = min(n - 1, r.bucket) * s.neighbour_bytes
    entry = s.signed_entry_bytes

    def search(calls: int, value_bytes: int, holders: int) -> float:
        """Bytes of a search asking ``calls`` nodes, ``holders`` of which answer with ``value_bytes``."""
        return calls * (s.find_request_bytes + neighbours + 2 * msg) + holders * value_bytes

    def store(value_bytes: int) -> float:
        return r.replicas * (value_bytes + entry + s.store_answer_bytes + 2 * msg)

    reads, full_reads = search_calls(n, r.beam, r.bucket), search_calls(n, r.full_read_beam, r.bucket)
    holders, full_holders = min(r.beam, n - 1), min(r.full_read_beam, n - 1)
    table = n * (s.peer_record_bytes + entry)  # every peer record, as one node answers a full read
    leases = r.candidates * (s.lease_bytes + entry)
    plan = n * s.plan_bytes_per_peer + entry
    # Finding a key's nodes searches a sibling id: neighbour lists only, beam of a whole bucket.
    finding = search_calls(n, r.bucket, r.bucket) * (s.find_request_bytes + neighbours + 2 * msg)
    full_read = search(full_reads, table + leases + plan + entry, full_holders) + 3 * search(full_reads, 0, 0)
    causes = {
        "summary": search(reads, s.summary_bytes + entry, holders) / r.summary_poll_s,
        "announce": (store(s.peer_record_bytes) + finding / (r.replicas_refresh_s / r.announce_s))
        / r.announce_s,
        "link_probes": (
            r.pinged_peers * r.pings * 2 * (s.ping_bytes + msg) / r.link_refresh_s
            + r.nearest * r.bandwidth_probe_bytes / r.bandwidth_refresh_s
        ),
        # The candidates' lease reads and writes, the planner's full reads and summaries: shared by all.
        "lease": min(r.candidates, n)
        * (search(full_reads, leases, full_holders) + store(s.lease_bytes))
        / r.lease_s
        / n,
        "planner": (full_read / r.planner_check_s + store(s.summary_bytes) / r.summary_write_s) / n,
        "churn_reads": r.churn_per_s * full_read,
    }
    causes["total"] = sum(causes.values())
    return causes


def hottest_bytes_s(n: int, sizes: Sizes | None = None, rates: Rates | None = None) -> dict[str, float]:
    """Bytes per second the busiest nodes send: those storing the summary key answer every peer's polls,
    those storing the peers key answer the planner's full reads (which the planner receives)."""
    s, r = sizes or Sizes(), rates or Rates()
    neighbours = min(n - 1, r.bucket) * s.neighbour_bytes
    answer = s.summary_bytes + s.signed_entry_bytes + neighbours + s.message_bytes
    polls_s = n / r.summary_poll_s * min(r.beam, n - 1) / min(r.replicas, n - 1) if n > 1 else 0.0
    table = n * (s.peer_record_bytes + s.signed_entry_bytes)
    return {"summary_holder": polls_s * answer, "peers_holder": table / r.planner_check_s}
