"""A paper model of one idle peer's background traffic as the swarm grows: the mean peer, and the busiest.

Every byte one peer sends another receives, so the mean bytes a peer sends per second is the bytes moved per
second by all of the swarm's background work, divided by the number of peers: each peer's own work (its
summary polls, announcements, pings) in full, plus its share of the planner's and the candidates' work. Each
piece of work is counted as the DHT or RPC messages it takes, each message as its payload plus a fixed framing
cost (`Sizes.message_bytes`: libp2p stream set-up, noise and yamux frames, TCP/IP headers and ACKs).

Reads and stores go straight to a key's `replicas` nodes (swarm.dht.node), found by a search for a sibling id
every `replicas_refresh_s`: a Kademlia search asks `bucket` nodes per round, one round more per factor of
`bucket` in swarm size past the first, and every answer carries the answering node's `bucket` nearest
neighbours. A read asks one of the key's nodes, the next one at each read, so the reads of all peers spread
over all of them.

The busiest node is an ordinary peer that also stores the keys read most (a summary copy, a peer-records
shard, the lease key), and answers its share of their reads (the plan key is read only after a change: the
planner knows its own plan); or the planner, which reads every
shard and writes every summary copy. Which nodes store which keys is chance: the model charges the busiest
node with the two heaviest roles one node can have at once.

The model is pure: the record sizes come from the caller (scripts/bench_dht.py measures them from real
records), and its output at the measured swarm sizes is printed beside the measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.types import PEER_SHARDS, summary_copies


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
    key_id_bytes: int = 33  # one more key in a read asking a node for several
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
    bandwidth_probe_bytes: int = (
        140_000  # both directions of one later, small measurement (LinkConfig.later_*)
    )
    nearest: int = 4  # LinkConfig.nearest: links whose bandwidth is probed
    lease_s: float = 10.0  # ElectionConfig.refresh_s: a candidate reads and writes the lease key
    candidates: int = 3  # ElectionConfig.max_candidates
    planner_check_s: float = 5.0  # PlannerConfig.check_interval_s: the planner reads every record
    summary_write_s: float = 15.0  # the planner refreshes its summary (DirectoryConfig.summary_refresh_s)
    replicas: int = 5  # nodes a DHT entry is stored at (hivemind's num_replicas)
    bucket: int = 20  # hivemind's bucket size
    shards: int = PEER_SHARDS  # keys the peer records are spread over
    churn_per_s: float = 0.0  # joins, leaves and moves per second (each makes every peer read every record)


def search_calls(n: int, beam: int, bucket: int) -> int:
    """Nodes a search asks in a swarm of ``n``: ``beam`` per round, one more round per factor of ``bucket``."""
    if n <= 1:
        return 0
    rounds = 1 + max(0, math.ceil(math.log(max(n / bucket, 1.0), bucket)))
    return min(n - 1, beam * rounds)


@dataclass(frozen=True)
class _Costs:
    """Bytes of the messages of a swarm of ``n``, both ways (see model_bytes_s)."""

    n: int
    s: Sizes
    r: Rates

    @property
    def neighbours(self) -> int:
        return min(self.n - 1, self.r.bucket) * self.s.neighbour_bytes

    def answer(self, value_bytes: float, keys: int = 1) -> float:
        """A node's answer to a read of ``keys`` keys: their values, neighbours for each, framing."""
        return value_bytes + keys * self.neighbours + self.s.message_bytes

    def request(self, keys: int = 1) -> float:
        return self.s.find_request_bytes + (keys - 1) * self.s.key_id_bytes + self.s.message_bytes

    def read(self, value_bytes: float, keys: int = 1) -> float:
        """One read of ``keys`` keys from one node, both ways."""
        return self.request(keys) + self.answer(value_bytes, keys)

    def finding(self, keys: int) -> float:
        """Finding the nodes of ``keys`` keys: a search for their sibling ids (neighbour lists only)."""
        calls = search_calls(self.n, self.r.bucket, self.r.bucket)
        return keys * calls * (self.s.find_request_bytes + self.neighbours + 2 * self.s.message_bytes)

    def store(self, value_bytes: float) -> float:
        """A store at a key's nodes, both ways."""
        s = self.s
        return self.r.replicas * (
            value_bytes + s.signed_entry_bytes + s.store_answer_bytes + 2 * s.message_bytes
        )

    @property
    def entry(self) -> int:
        return self.s.signed_entry_bytes

    @property
    def table(self) -> float:
        """Every peer record as stored (with its signed entry)."""
        return self.n * (self.s.peer_record_bytes + self.entry)

    @property
    def leases(self) -> float:
        return min(self.r.candidates, self.n) * (self.s.lease_bytes + self.entry)

    @property
    def plan(self) -> float:
        return self.n * self.s.plan_bytes_per_peer + self.entry

    @property
    def copies(self) -> int:
        return summary_copies(self.n)

    @property
    def keys_per_snapshot(self) -> int:
        return self.r.shards + 2  # the shards, the lease key, the reports key (the planner knows its plan)

    def snapshot_calls(self) -> int:
        """Nodes a full read asks: one per key, the keys a node stores asked of it at once."""
        return min(self.keys_per_snapshot, max(self.n - 1, 1))

    def snapshot(self, plan: bool = False) -> float:
        """A full read (every shard, leases and reports; the plan too with ``plan``), both ways."""
        calls = self.snapshot_calls()
        per_call = self.keys_per_snapshot / calls
        values = self.table + self.leases + self.entry + (self.read(self.plan) if plan else 0.0)
        return (
            calls * self.request(round(per_call))
            + values
            + self.keys_per_snapshot * self.neighbours
            + calls * self.s.message_bytes
        )


def model_bytes_s(n: int, sizes: Sizes | None = None, rates: Rates | None = None) -> dict[str, float]:
    """Bytes per second the mean idle peer of a swarm of ``n`` sends (= receives), by cause, and "total"."""
    s, r = sizes or Sizes(), rates or Rates()
    c = _Costs(n, s, r)
    refresh = r.replicas_refresh_s
    causes = {
        "summary": c.read(s.summary_bytes + c.entry) / r.summary_poll_s + c.finding(1) / refresh,
        "announce": c.store(s.peer_record_bytes) / r.announce_s + c.finding(1) / refresh,
        "link_probes": (
            r.pinged_peers * r.pings * 2 * (s.ping_bytes + s.message_bytes) / r.link_refresh_s
            + r.nearest * r.bandwidth_probe_bytes / r.bandwidth_refresh_s
        ),
        # The candidates' lease reads and writes, the planner's full reads and summaries: shared by all.
        "lease": min(r.candidates, n) * (c.read(c.leases) + c.store(s.lease_bytes)) / r.lease_s / n,
        "planner": (
            c.snapshot() / r.planner_check_s
            + c.copies * c.store(s.summary_bytes) / r.summary_write_s
            + c.finding(c.keys_per_snapshot + c.copies) / refresh
        )
        / n,
        "churn_reads": r.churn_per_s * c.snapshot(plan=True),
    }
    causes["total"] = sum(causes.values())
    return causes


def holder_bytes_s(n: int, sizes: Sizes | None = None, rates: Rates | None = None) -> dict[str, float]:
    """Bytes per second a node storing each key sends on top of the mean peer's, answering its share of the
    reads (a read asks one of the key's `replicas` nodes); and "planner", what the planner sends on top."""
    s, r = sizes or Sizes(), rates or Rates()
    c = _Costs(n, s, r)
    share = 1 / min(r.replicas, max(n - 1, 1))
    readers = n / c.copies  # peers reading one summary copy
    calls = c.snapshot_calls()
    return {
        "summary_holder": readers / r.summary_poll_s * share * c.answer(s.summary_bytes + c.entry),
        "shard_holder": share / r.planner_check_s * c.answer(c.table / r.shards),
        "lease_holder": share
        * (min(r.candidates, n) / r.lease_s + 1 / r.planner_check_s)
        * c.answer(c.leases),
        "planner": (
            calls * c.request(round(c.keys_per_snapshot / calls)) / r.planner_check_s
            + c.copies * c.store(s.summary_bytes) / r.summary_write_s
        ),
    }


def busiest_bytes_s(n: int, sizes: Sizes | None = None, rates: Rates | None = None) -> float:
    """Bytes per second the busiest idle node sends: the mean peer's, plus the two heaviest roles (storing
    keys, planning) a node can have at once (see the module doc). The planner never stores its own summary
    (a store goes to the key's nearest nodes other than the writer)."""
    roles = holder_bytes_s(n, sizes, rates)
    planner = roles.pop("planner")
    holding = sorted(roles.values(), reverse=True)
    others = [v for k, v in roles.items() if k != "summary_holder"]
    extra = max(sum(holding[:2]), planner + max(others))
    return model_bytes_s(n, sizes, rates)["total"] + extra
