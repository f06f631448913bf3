"""The swarm directory: announce this peer, read a typed snapshot of everyone, publish the plan and reports.

Every value read back is checked four times: hivemind verified the RSA signature of its subkey, the schema
validator checked its shape on the storing node, here we parse it with the strict pydantic model and require
its peer id to be the one the signing key hashes to, and swarm.dht.trust checks it against the clock, the
agreed model shape, the lease and the other records. Anything failing is dropped (counted in `rejections`,
logged once), never trusted and never raised. At most MAX_RECORDS_PER_KEY subkeys of a key are parsed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic

from swarm.dht.identity import owner_peer_id
from swarm.dht.lease import LEASE_S, lease_holder
from swarm.dht.node import SwarmDHT
from swarm.dht.schemas import (
    DIGEST_CHARS,
    PEER_SHARDS,
    LeaseRecord,
    PeerRecord,
    PlanRecord,
    ReportRecord,
    SummaryRecord,
    lease_key,
    peers_key,
    plan_key,
    record_key,
    reports_key,
    shard_of,
    summary_key,
)
from swarm.dht.traffic import TrafficMeter, payload_bytes, read_bytes
from swarm.dht.trust import (
    EpochGuard,
    LeaseWitness,
    ModelShape,
    Rejections,
    plan_problem,
    reporters_by_accused,
    time_problem,
)
from swarm.types import LayerRange
from swarm.types import coverage as layer_coverage

logger = logging.getLogger(__name__)

R = TypeVar("R", PeerRecord, PlanRecord, LeaseRecord, ReportRecord, SummaryRecord)
MAX_RECORDS_PER_KEY = 1024  # subkeys parsed per key and read: RSA key parsing is the costly part
MAX_REPORTS_PER_REPORTER = 16  # one reporter cannot fill the reports key on its own
CONFIRM_ASK = 2  # more nodes asked when a read lacks a record that should still be alive
CLOCK_MARGIN_S = 1.0  # how far a storing node's clock may run ahead before its missing record is doubted


@dataclass(frozen=True)
class DirectoryConfig:
    """Lifetimes of the records this peer writes."""

    ttl_s: float = 30.0  # a peer record vanishes this long after its writer stops refreshing it
    plan_ttl_s: float = 300.0  # a plan outlives its planner long enough for a successor to take over
    read_timeout_s: float = 15.0  # deadline of one snapshot read
    write_timeout_s: float = 5.0  # deadline of one announcement or withdrawal
    report_ttl_s: float = 600.0  # a misbehaviour report counts this long after it was written
    lease_s: float = (
        LEASE_S  # the planner lease period (ElectionConfig.lease_s): how far a claim may be back-dated
    )
    max_record_ttl_s: float = 900.0  # readers drop records that claim to live longer than this
    summary_ttl_s: float = 30.0  # the planner's summary vanishes this long after its last refresh

    def __post_init__(self) -> None:
        if (
            min(
                self.ttl_s,
                self.plan_ttl_s,
                self.read_timeout_s,
                self.write_timeout_s,
                self.report_ttl_s,
                self.summary_ttl_s,
            )
            <= 0
        ):
            raise ValueError(
                "ttl_s, plan_ttl_s, read/write_timeout_s, report_ttl_s, summary_ttl_s must be > 0"
            )
        if max(self.ttl_s, self.plan_ttl_s, self.report_ttl_s, self.summary_ttl_s) > self.max_record_ttl_s:
            raise ValueError(
                "ttl_s, plan_ttl_s, report_ttl_s and summary_ttl_s must not exceed max_record_ttl_s"
            )

    @property
    def refresh_s(self) -> float:
        """How often a writer refreshes its record: three chances before it expires."""
        return self.ttl_s / 3

    @property
    def summary_refresh_s(self) -> float:
        """How often the planner stores an unchanged summary again: twice per summary_ttl_s, a failed store
        retried at each planner check meanwhile (the planner writes one copy per 100 peers: each store counts)."""
        return self.summary_ttl_s / 2


@dataclass(frozen=True)
class SwarmSnapshot:
    """What the DHT said at `fetched_at`: live, valid, correctly signed records only."""

    peers: Mapping[str, PeerRecord]  # by peer id, any state ("loading", "serving", "leaving")
    plan: PlanRecord | None  # the lease holder's plan, if it fits `peers` and its epoch did not jump
    planner_peer_id: str | None  # the current planner-lease holder
    fetched_at: float  # DHT time (unix seconds)
    leases: Mapping[str, LeaseRecord] = field(default_factory=dict)
    reports: Mapping[str, frozenset[str]] = field(default_factory=dict)  # accused -> distinct reporters

    def serving(self) -> dict[str, PeerRecord]:
        return {pid: r for pid, r in self.peers.items() if r.state == "serving"}


async def _nothing() -> dict[str, dict[Any, tuple[Any, float]]]:
    return {}


def coverage(snapshot: SwarmSnapshot, num_layers: int) -> list[int]:
    """How many serving peers hold each layer (a 0 means no route can exist)."""
    held = (
        LayerRange(r.range_start, r.range_end)
        for r in snapshot.serving().values()
        if r.range_end > r.range_start  # a record may hold nothing yet
    )
    return layer_coverage(held, num_layers)


def membership_digest(peers: Mapping[str, PeerRecord]) -> str:
    """Who is in the swarm, in which state, holding which layers: a change here (a join, a leave, a move)
    makes readers of the summary re-read the records; speeds, load and links do not."""
    h = hashlib.sha256()
    for pid in sorted(peers):
        r = peers[pid]
        h.update(f"{pid}/{r.state}/{r.range_start}/{r.range_end};".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def parse_records(
    raw: Mapping[Any, tuple[Any, float]],
    model: type[R],
    what: str,
    *,
    rejections: Rejections | None = None,
    now: float | None = None,
    max_ttl_s: float = float("inf"),
) -> dict[str, R]:
    """Validated records keyed by the signer's peer id; a record naming another peer id is dropped.

    With `now`, records whose times cannot be true are dropped too (swarm.dht.trust.time_problem)."""
    rejections = rejections or Rejections()
    records: dict[str, R] = {}
    for subkey, value, expiration in capped(raw):
        signer = owner_peer_id(subkey)
        record = parse_one(value, model, what, signer, rejections)
        if record is None:
            continue
        if now is not None and (problem := time_problem(record, expiration, now, max_ttl_s)) is not None:
            rejections.drop(what, signer, problem)
            continue
        records[signer] = record  # type: ignore[index]  # parse_one checked the signer
    return records


def capped(raw: Mapping[Any, tuple[Any, float]]) -> list[tuple[Any, Any, float]]:
    """At most MAX_RECORDS_PER_KEY of raw's items, chosen by a hash of the subkey (no writer picks its place
    without generating keys)."""
    items = [(subkey, value, expiration) for subkey, (value, expiration) in raw.items()]
    if len(items) > MAX_RECORDS_PER_KEY:
        items.sort(key=lambda item: hashlib.sha256(repr(item[0]).encode()).digest())
        items = items[:MAX_RECORDS_PER_KEY]
    return items


def parse_one(value: Any, model: type[R], what: str, signer: str | None, rejections: Rejections) -> R | None:
    """The record in `value` if it is valid and names its signer; None (counted, logged once) otherwise."""
    try:
        record = model.from_dht(value)
    except pydantic.ValidationError as e:
        rejections.drop(what, signer, f"invalid ({e.error_count()} errors: {_first_error(e)})")
        return None
    if isinstance(record, PlanRecord | SummaryRecord):
        claimed = record.planner_peer_id
    elif isinstance(record, ReportRecord):
        claimed = record.reporter_peer_id
    else:
        claimed = record.peer_id
    if signer is None or claimed != signer:
        rejections.drop(what, signer, f"names {claimed[-8:]}, not its signer")
        return None
    return record


def _first_error(e: pydantic.ValidationError) -> str:
    first = e.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"[:200]


def pick_plan(plans: Mapping[str, PlanRecord], planner_peer_id: str | None) -> PlanRecord | None:
    """The current planner's plan: plans signed by anyone else are not followed, whatever their epoch."""
    if planner_peer_id is None:
        return None
    return plans.get(planner_peer_id)


class Directory:
    """Reads and writes this model's records in the DHT (the only typed door to them)."""

    def __init__(
        self, dht: SwarmDHT, config: DirectoryConfig | None = None, *, shape: ModelShape | None = None
    ) -> None:
        """`shape`: the model's shape from its spec (whose hash names our keys); peers announcing another
        are dropped. Without it (status tools), each record's own num_layers bounds what a plan may place."""
        self.dht = dht
        self.config = config or DirectoryConfig()
        self.shape = shape
        self.rejections = Rejections()  # dropped records by kind, for tests and status
        self._witness = LeaseWitness()  # when we first saw each lease claim
        self._epochs = EpochGuard()  # the newest plan epoch we accepted
        self._last_record: PeerRecord | None = None
        self._last_expiration = 0.0
        self.traffic = TrafficMeter()  # payload bytes of our reads and writes, by cause
        self._seen: dict[str, dict[Any, float]] = {}  # key -> {subkey: expiration} of our last read of it
        self.confirmations = 0  # keys read again from more nodes (see _read), for status and benchmarks
        self._summary_copies = 1  # keys our last summary went to (a shrink keeps writing them a while)
        self._summary_copies_until = float("-inf")

    @property
    def accepted_epoch(self) -> int | None:
        """The newest plan epoch a snapshot of ours accepted (a new planner continues from it)."""
        return self._epochs.epoch

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    @property
    def model_hash(self) -> str:
        return self.dht.model_hash

    @property
    def write_timeout_s(self) -> float:
        return self.config.write_timeout_s

    def key_names(self) -> tuple[str, ...]:
        """The DHT keys of this model's records (the first summary copy only)."""
        h = self.dht.model_hash
        shards = tuple(peers_key(h, s) for s in range(PEER_SHARDS))
        return (*shards, plan_key(h), lease_key(h), reports_key(h), summary_key(h))

    def now(self) -> float:
        """DHT time (unix seconds), the clock every record is dated by."""
        return self.dht.now()

    async def announce(self, record: PeerRecord) -> bool:
        """Store our record (stamped with the current time) until now + ttl_s; True if some node took it."""
        if record.peer_id != self.dht.peer_id:
            raise ValueError(f"record is for {record.peer_id}, but this node is {self.dht.peer_id}")
        if record.model_hash != self.dht.model_hash:
            raise ValueError(
                f"record is for model {record.model_hash}, this DHT serves {self.dht.model_hash}"
            )
        now = self.dht.now()
        record = record.model_copy(update={"updated_at": now})
        # Expirations must grow, or the DHT keeps the older value.
        expiration = max(now + self.config.ttl_s, self._last_expiration + 1e-3)
        value = record.to_dht()
        self.traffic.add("announce", sent=payload_bytes(value))
        stored = await self.dht.store(
            record_key(self.dht.model_hash, self.dht.peer_id), self.dht.own_subkey(), value, expiration
        )
        if stored:
            self._last_record, self._last_expiration = record, expiration
        return stored

    async def withdraw(self) -> None:
        """Mark our record "leaving" (a DHT value cannot be shortened; it disappears at its old expiry)."""
        if self._last_record is None:
            return
        leaving = self._last_record.model_copy(update={"state": "leaving", "free_cache_tokens": 0})
        expiration = self._last_expiration + 1e-3
        value = leaving.to_dht()
        self.traffic.add("announce", sent=payload_bytes(value))
        key = record_key(self.dht.model_hash, self.dht.peer_id)
        await self.dht.store(key, self.dht.own_subkey(), value, expiration)
        self._last_record = None
        logger.info("withdrew from the directory")

    async def publish_plan(self, plan: PlanRecord) -> bool:
        """Store a plan under our own subkey; only the elected planner should call this."""
        if plan.planner_peer_id != self.dht.peer_id:
            raise ValueError(
                f"plan names planner {plan.planner_peer_id}, but this node is {self.dht.peer_id}"
            )
        expiration = self.dht.now() + self.config.plan_ttl_s
        value = plan.to_dht()
        self.traffic.add("plan", sent=payload_bytes(value))
        return await self.dht.store(plan_key(self.dht.model_hash), self.dht.own_subkey(), value, expiration)

    async def publish_summary(self, summary: SummaryRecord) -> bool:
        """Store the swarm's summary under our subkey of each of its ``copies`` keys (and, for summary_ttl_s
        after their number shrank, of the keys readers may still read); only the elected planner should call
        this. True if some node took each copy."""
        if summary.planner_peer_id != self.dht.peer_id:
            raise ValueError(f"summary names {summary.planner_peer_id}, but this node is {self.dht.peer_id}")
        now = self.dht.now()
        expiration = now + self.config.summary_ttl_s
        if summary.copies >= self._summary_copies or now >= self._summary_copies_until:
            self._summary_copies, self._summary_copies_until = summary.copies, expiration
        value = summary.to_dht()
        keys = [summary_key(self.dht.model_hash, c) for c in range(self._summary_copies)]
        self.traffic.add("summary", sent=len(keys) * payload_bytes(value))
        stored = await asyncio.gather(
            *(self.dht.store(key, self.dht.own_subkey(), value, expiration) for key in keys)
        )
        return all(stored)

    async def read_summaries(self, copy: int = 0) -> dict[str, SummaryRecord]:
        """Valid summaries by signer, read from one of the nodes that store summary copy ``copy``."""
        key = summary_key(self.dht.model_hash, copy)
        raw = (await self._read((key,)))[key]
        self.traffic.add("summary", received=read_bytes(raw))
        return self._parse(raw, SummaryRecord, "summary")

    async def write_lease(self, lease: LeaseRecord, expiration: float) -> bool:
        if lease.peer_id != self.dht.peer_id:
            raise ValueError(f"lease is for {lease.peer_id}, but this node is {self.dht.peer_id}")
        value = lease.to_dht()
        self.traffic.add("lease", sent=payload_bytes(value))
        return await self.dht.store(lease_key(self.dht.model_hash), self.dht.own_subkey(), value, expiration)

    async def publish_report(self, report: ReportRecord) -> bool:
        """Store a signed misbehaviour report under our subkey for the accused peer (one per accused: a new
        report replaces our older one); True if some node took it. It counts for report_ttl_s."""
        if report.reporter_peer_id != self.dht.peer_id:
            raise ValueError(f"report is by {report.reporter_peer_id}, but this node is {self.dht.peer_id}")
        subkey = self.dht.own_subkey() + b"/" + report.accused_peer_id.encode()
        expiration = self.dht.now() + self.config.report_ttl_s
        value = report.to_dht()
        self.traffic.add("reports", sent=payload_bytes(value))
        return await self.dht.store(reports_key(self.dht.model_hash), subkey, value, expiration)

    async def _read(
        self, keys: Sequence[str], thorough: bool = False
    ) -> dict[str, dict[Any, tuple[Any, float]]]:
        """Each of ``keys`` read from one of the nodes storing it (SwarmDHT.read_near). A key whose read lacks
        a subkey our last read of it had, before that subkey's expiration, or has an older one (no honest
        writer removes a subkey or dates one back, so the node asked missed stores, is new, or withholds
        them), is read again from CONFIRM_ASK more nodes and the answers merged; a key we never read (or
        every key, ``thorough``) is asked of 1 + CONFIRM_ASK nodes at once."""
        new = [key for key in keys if thorough or key not in self._seen]  # first reads ask more nodes
        known = [key for key in keys if key in self._seen and key not in new]  # else its wider answer is lost
        first, again_ = await asyncio.gather(
            self.dht.read_near(new, ask=1 + CONFIRM_ASK) if new else _nothing(),
            self.dht.read_near(known) if known else _nothing(),
        )
        raws = {**first, **again_}
        now = self.dht.now()
        alive = now + CLOCK_MARGIN_S  # a node whose clock runs ahead drops records a little early
        doubtful = [
            k
            for k in keys
            if any(
                e > alive and raws[k].get(sk, (None, 0.0))[1] < e for sk, e in self._seen.get(k, {}).items()
            )
        ]
        if doubtful:
            self.confirmations += len(doubtful)
            again = await self.dht.read_near(doubtful, ask=CONFIRM_ASK)
            for key in doubtful:
                merged = dict(raws[key])
                for subkey, item in again[key].items():
                    if subkey not in merged or item[1] > merged[subkey][1]:
                        merged[subkey] = item
                raws[key] = merged
        for key in keys:
            self._seen[key] = {subkey: expiration for subkey, (_value, expiration) in raws[key].items()}
        return raws

    def _peers_of(self, raws: Mapping[str, Mapping[Any, tuple[Any, float]]]) -> dict[str, PeerRecord]:
        """The valid peer records of every shard read, each only from the shard it belongs in."""
        kept = {}
        for shard in range(PEER_SHARDS):
            raw = raws.get(peers_key(self.dht.model_hash, shard), {})
            self.traffic.add("peer_reads", received=read_bytes(raw))
            for pid, r in self._parse(raw, PeerRecord, "peer").items():
                if shard_of(pid) != shard:
                    self.rejections.drop("peer", pid, f"stored in peer shard {shard}, not {shard_of(pid)}")
                elif r.model_hash != self.dht.model_hash:
                    self.rejections.drop("peer", pid, f"announces model {r.model_hash[:16]}")
                elif self.shape is not None and (r.num_layers, r.hidden_size) != (
                    self.shape.num_layers,
                    self.shape.hidden_size,
                ):
                    self.rejections.drop("peer", pid, f"announces {r.num_layers} layers of {r.hidden_size}")
                else:
                    kept[pid] = r
        return kept

    async def read_peers(self) -> dict[str, PeerRecord]:
        keys = [peers_key(self.dht.model_hash, s) for s in range(PEER_SHARDS)]
        return self._peers_of(await self._read(keys))

    async def read_plans(self) -> dict[str, PlanRecord]:
        key = plan_key(self.dht.model_hash)
        raw = (await self._read((key,)))[key]
        self.traffic.add("plan", received=read_bytes(raw))
        return self._parse(raw, PlanRecord, "plan")

    async def read_leases(self) -> dict[str, LeaseRecord]:
        """Live lease records with their times clamped to when we first saw them (swarm.dht.trust)."""
        key = lease_key(self.dht.model_hash)
        return self._leases_of((await self._read((key,)))[key])

    def _leases_of(self, raw: Mapping[Any, tuple[Any, float]]) -> dict[str, LeaseRecord]:
        self.traffic.add("lease", received=read_bytes(raw))
        leases = self._parse(raw, LeaseRecord, "lease")
        return self._witness.clamp(leases, self.dht.now(), self.config.lease_s)

    async def read_reports(self) -> list[ReportRecord]:
        """Live, valid reports, at most MAX_REPORTS_PER_REPORTER per reporter."""
        key = reports_key(self.dht.model_hash)
        return self._reports_of((await self._read((key,)))[key])

    def _reports_of(self, raw: Mapping[Any, tuple[Any, float]]) -> list[ReportRecord]:
        self.traffic.add("reports", received=read_bytes(raw))
        now, per_reporter = self.dht.now(), dict[str, int]()
        reports = []
        for subkey, value, expiration in capped(raw):
            signer = owner_peer_id(subkey)
            report = parse_one(value, ReportRecord, "report", signer, self.rejections)
            if report is None or per_reporter.get(report.reporter_peer_id, 0) >= MAX_REPORTS_PER_REPORTER:
                continue
            problem = time_problem(report, expiration, now, self.config.report_ttl_s)
            if problem is None and report.created_at < now - self.config.report_ttl_s:
                problem = "older than report_ttl_s"
            if problem is not None:
                self.rejections.drop("report", signer, problem)
                continue
            per_reporter[report.reporter_peer_id] = per_reporter.get(report.reporter_peer_id, 0) + 1
            reports.append(report)
        return reports

    def _parse(self, raw: Mapping[Any, tuple[Any, float]], model: type[R], what: str) -> dict[str, R]:
        return parse_records(
            raw,
            model,
            what,
            rejections=self.rejections,
            now=self.dht.now(),
            max_ttl_s=self.config.max_record_ttl_s,
        )

    async def snapshot(self, plans: bool = True, thorough: bool = False) -> SwarmSnapshot:
        """One consistent-enough view: peers, leases, plans and reports read at once (the keys a node stores
        in one request to it), with a deadline. ``plans=False`` skips the plan key (the planner, which knows
        its own plan): the snapshot has no plan then. ``thorough``: every key asked of 1 + CONFIRM_ASK nodes.

        The plan is the lease holder's, and only if it fits the peers read and its epoch did not jump."""
        h = self.dht.model_hash
        keys = [*(peers_key(h, s) for s in range(PEER_SHARDS)), lease_key(h), reports_key(h)]
        if plans:
            keys.append(plan_key(h))
        async with asyncio.timeout(self.config.read_timeout_s):
            raws = await self._read(keys, thorough)
        peers = self._peers_of(raws)
        raw_plans = raws.get(plan_key(h), {})
        self.traffic.add("plan", received=read_bytes(raw_plans))
        plans_read = self._parse(raw_plans, PlanRecord, "plan")
        leases = self._leases_of(raws[lease_key(h)])
        reports = self._reports_of(raws[reports_key(h)])
        holder = lease_holder(leases, self.dht.model_hash)
        now = self.dht.now()
        return SwarmSnapshot(
            peers=peers,
            plan=self._trusted_plan(pick_plan(plans_read, holder), peers, now),
            planner_peer_id=holder,
            fetched_at=now,
            leases=leases,
            reports=reporters_by_accused(reports),
        )

    def _trusted_plan(
        self, plan: PlanRecord | None, peers: Mapping[str, PeerRecord], now: float
    ) -> PlanRecord | None:
        if plan is None:
            return None
        num_layers = self.shape.num_layers if self.shape is not None else None
        problem = plan_problem(plan, peers, num_layers) or self._epochs.problem(plan.epoch, now)
        if problem is not None:
            self.rejections.drop("plan", plan.planner_peer_id, problem)
            return None
        self._epochs.accept(plan.epoch, now)
        return plan


class Announcer:
    """Keeps this peer's record fresh: announces `current_record()` every ttl_s / 3, withdraws on exit."""

    def __init__(self, directory: Directory, current_record: Callable[[], PeerRecord]) -> None:
        self.directory = directory
        self.current_record = current_record
        self.announced = asyncio.Event()  # set after the first successful store

    async def run(self) -> None:
        try:
            while True:
                await self._announce_once()
                await asyncio.sleep(self._period_s)
        finally:
            # Shielded with a deadline: the record must go even when we are being cancelled.
            try:
                async with asyncio.timeout(self.directory.config.write_timeout_s):
                    await asyncio.shield(self.directory.withdraw())
            except (TimeoutError, OSError, RuntimeError) as e:
                logger.warning("could not withdraw our record (%r); it expires on its own", e)

    async def _announce_once(self) -> None:
        """One refresh, with a deadline. A failure is logged and the next period tries again: the record
        outlives two missed refreshes, while an announcer that died would drop a live peer from the swarm."""
        try:
            async with asyncio.timeout(self.directory.config.write_timeout_s):
                stored = await self.directory.announce(self.current_record())
        except Exception as e:
            expected = isinstance(e, TimeoutError | OSError | RuntimeError)
            logger.warning(
                "announce failed (%r); retrying in %.1f s", e, self._period_s, exc_info=not expected
            )
            return
        if stored:
            self.announced.set()
        else:
            logger.warning("no DHT node accepted our record; retrying in %.1f s", self._period_s)

    @property
    def _period_s(self) -> float:
        return self.directory.config.refresh_s
