"""What a reader of the DHT believes, and why: anyone can write records, so each one must earn its place.

Every rule here is a pure function of the records, the reader's clock and (for leases and epochs) what this
reader saw before; Directory applies them to every read:

* Time. No record may claim a stamp in the future (beyond MAX_CLOCK_SKEW_S) or live longer than the reader's
  max_record_ttl_s from its stamp: a record stored with an expiration years away is dropped, not kept forever.
* Leases. A claim counts from no earlier than one lease period before this reader first saw it
  (`LeaseWitness`): nobody can back-date a claim further than that, so a fresh key writing `held_since=0`
  cannot displace a holder that has held the lease for longer than a lease period in the reader's sight.
  The lease-period allowance keeps split-brain healing symmetric: two claims made within a lease period of
  the reunion compare by their true times on every side (longer splits are a known limit, see docs/security.md). Ties are broken by sha256(peer id,
  model hash) (`tie_rank`): grinding a winning rank costs one RSA key generation per try and must be redone
  for every model, where the old "smallest id" could be ground once for all swarms.
* Plans. Only the lease holder's plan is used, and only if it places peers the snapshot knows, each within
  its announced max_layers and the model's layers (`plan_problem`), and its epoch does not jump
  (`EpochGuard`: at most EPOCH_SLACK + EPOCH_RATE_PER_S * seconds since the last accepted epoch; an honest
  planner publishes at most once per check interval, >= 1 s, so it stays within the bound, while a hostile
  one cannot exhaust the epoch space: 2^53 epochs take 285 million years).
* Reports. A peer accused by `min_reporters` distinct reporters is excluded by planners and clients alike.

Dropped records are counted by kind in `Rejections` and logged once per writer and reason, not every read.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from swarm.dht.schemas import LeaseRecord, PeerRecord, PlanRecord, ReportRecord, SummaryRecord

logger = logging.getLogger(__name__)

MAX_CLOCK_SKEW_S = 30.0  # how far in the future a writer's clock may run ahead of ours
EPOCH_SLACK = 2  # epochs a plan may be ahead of the last accepted one with no time passed
EPOCH_RATE_PER_S = 1.0  # and one more per second since then
MAX_LOGGED = 1024  # distinct (kind, writer, reason) warnings kept; beyond that, rejections are only counted
# Defaults shared by the planner's and the clients' settings (one default each):
MIN_REPORTERS = 2  # distinct reporters that exclude a peer (0: never)
MAX_LAYER_TOKENS_S = 1e6  # announced decode tokens/s per layer above this count as this (a plausibility cap)


@dataclass(frozen=True)
class ModelShape:
    """The model's shape as the swarm agreed on it: from the model spec whose hash names the DHT keys."""

    num_layers: int
    hidden_size: int


class Rejections:
    """Counts dropped records by kind; warns once per (kind, writer, reason), then stays quiet."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, str, str]] = set()

    def drop(self, kind: str, writer: str | None, reason: str) -> None:
        self.counts[kind] += 1
        key = (kind, writer or "?", reason)
        if key in self._logged or len(self._logged) >= MAX_LOGGED:
            logger.debug("dropped %s record from %s: %s", kind, writer, reason)
            return
        self._logged.add(key)
        logger.warning("dropping %s record from %s: %s (logged once)", kind, (writer or "?")[-8:], reason)


def stamp_of(record: PeerRecord | PlanRecord | LeaseRecord | ReportRecord | SummaryRecord) -> float:
    """When the writer says it wrote the record (unix seconds)."""
    if isinstance(record, PeerRecord | LeaseRecord):
        return record.updated_at
    return record.created_at


def time_problem(
    record: PeerRecord | PlanRecord | LeaseRecord | ReportRecord | SummaryRecord,
    expiration: float,
    now: float,
    max_ttl_s: float,
) -> str | None:
    """Why the record's times cannot be true (None: they can)."""
    latest = now + MAX_CLOCK_SKEW_S
    stamps = [stamp_of(record)]
    if isinstance(record, LeaseRecord):
        stamps += [record.candidate_since] + ([record.held_since] if record.held_since is not None else [])
    if max(stamps) > latest:
        return f"a time stamp {max(stamps) - now:.0f} s in the future"
    # A plan keeps its created_at through refreshes: bound its expiration from now instead.
    written = now if isinstance(record, PlanRecord) else stamp_of(record)
    if expiration > written + max_ttl_s + MAX_CLOCK_SKEW_S:
        return f"expires {expiration - written:.0f} s after it was written (at most {max_ttl_s:.0f} s)"
    return None


def tie_rank(peer_id: str, salt: str) -> bytes:
    """Who wins a tie: the smallest sha256(peer id, salt); the salt is the model hash, the same for all."""
    return hashlib.sha256(f"{salt}/{peer_id}".encode()).digest()


class LeaseWitness:
    """Remembers when this reader first saw each candidacy and claim, and clamps lease times to no earlier
    than `horizon_s` (the lease period) before that.

    An entry outlives a few missed reads (a DHT read may miss a record): were the holder's claim forgotten
    after one, it would look newer than a back-dated claim the reader kept seeing.
    """

    FORGET_AFTER_S = 600.0
    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, float], tuple[float, float]] = {}  # key -> (first, last) seen

    def clamp(
        self, leases: Mapping[str, LeaseRecord], now: float, horizon_s: float
    ) -> dict[str, LeaseRecord]:
        clamped = {pid: self._clamp_one(pid, record, now, horizon_s) for pid, record in leases.items()}
        self._forget(now)
        return clamped

    def _first_seen(self, key: tuple[str, str, float], now: float) -> float:
        first = self._seen.get(key, (now, now))[0]
        self._seen[key] = (first, now)
        return first

    def _clamp_one(self, pid: str, record: LeaseRecord, now: float, horizon_s: float) -> LeaseRecord:
        seen = self._first_seen((pid, "candidate", record.candidate_since), now)
        candidate = max(record.candidate_since, seen - horizon_s)
        held = record.held_since
        if held is not None:
            held = max(held, candidate, self._first_seen((pid, "held", held), now) - horizon_s)
        if (candidate, held) == (record.candidate_since, record.held_since):
            return record
        return record.model_copy(update={"candidate_since": candidate, "held_since": held})

    def _forget(self, now: float) -> None:
        keep = {k: v for k, v in self._seen.items() if now - v[1] <= self.FORGET_AFTER_S}
        if len(keep) > self.MAX_ENTRIES:  # a flood of fresh keys: keep the longest-known ones
            keep = dict(sorted(keep.items(), key=lambda kv: kv[1][0])[: self.MAX_ENTRIES])
        self._seen = keep


def plan_problem(record: PlanRecord, peers: Mapping[str, PeerRecord], num_layers: int | None) -> str | None:
    """Why the plan does not fit the snapshot (None: it does): it may place only peers the snapshot knows,
    each within its announced max_layers and the model's layers."""
    plan = record.to_plan()
    for node, layers in plan.placement.items():
        peer = peers.get(node)
        if peer is None:
            return f"places {node[-8:]}, which has no live record"
        limit = peer.num_layers if num_layers is None else min(num_layers, peer.num_layers)
        if layers.end > limit:
            return f"places {node[-8:]} on {layers}, past the model's {limit} layers"
        if len(layers) > peer.max_layers:
            return f"places {len(layers)} layers on {node[-8:]}, which holds at most {peer.max_layers}"
    return None


class EpochGuard:
    """The highest plan epoch this reader accepted, and how far the next one may jump."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self._at = 0.0

    def problem(self, epoch: int, now: float) -> str | None:
        if self.epoch is None or epoch <= self.epoch:
            return None
        allowed = self.epoch + EPOCH_SLACK + int(max(0.0, now - self._at) * EPOCH_RATE_PER_S)
        return (
            None if epoch <= allowed else f"epoch {epoch} jumps past {allowed} (last accepted {self.epoch})"
        )

    def accept(self, epoch: int, now: float) -> None:
        if self.epoch is None or epoch > self.epoch:
            self.epoch, self._at = epoch, now


def reporters_by_accused(reports: list[ReportRecord]) -> dict[str, frozenset[str]]:
    """Accused peer id -> the distinct peer ids that reported it."""
    found: dict[str, set[str]] = {}
    for report in reports:
        found.setdefault(report.accused_peer_id, set()).add(report.reporter_peer_id)
    return {accused: frozenset(by) for accused, by in found.items()}


def excluded_peers(reports: Mapping[str, frozenset[str]], min_reporters: int) -> frozenset[str]:
    """Peers reported by at least `min_reporters` distinct reporters (0 turns exclusion off)."""
    if min_reporters <= 0:
        return frozenset()
    return frozenset(accused for accused, by in reports.items() if len(by) >= min_reporters)
