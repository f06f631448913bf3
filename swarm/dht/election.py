"""Planner election: at most one live planner per model, through a lease kept in the DHT.

Every candidate keeps a LeaseRecord under its own signed subkey, refreshed every lease_s / 3 and expiring
lease_s after its last refresh. The rule, applied by every candidate to the same records:

  1. If some live record claims the lease (held_since set), the earliest claim holds it (ties: the smallest
     rank, sha256 of the model hash and the peer id). A holder renews by refreshing, so leadership is sticky:
     a newcomer never displaces it.
  2. If nobody holds it, the candidate with the smallest rank wins, once its candidacy has been around for
     settle_s (time for everyone's candidacies to reach the DHT before anyone claims).

The times are the ones the reader can vouch for (swarm.dht.trust.LeaseWitness clamps each to when the
reader first saw it, Directory.read_leases drops impossible ones): a claim back-dated to 0 by a new key does
not beat a holder the swarm has been watching.

Not every peer stands: with the swarm's view passed in, only the max_candidates peers of smallest rank do
(swarm.dht.lease.may_stand), or anyone while nobody stands, so the lease key every candidate reads stays small
however large the swarm. A holder always stands until it loses the lease.

A dead holder's record expires after at most lease_s; the next candidate reads that within lease_s / 3 and
claims at once (its candidacy has long settled), so a successor appears within two lease periods. Two nodes
that claimed while they could not see each other resolve by rule 1 on their next read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from swarm.dht.lease import LEASE_S, decide, may_stand
from swarm.dht.schemas import LeaseRecord
from swarm.settings import setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElectionConfig:
    """Planner election and planning"""

    lease_s: float = setting(
        LEASE_S, "planner lease: a holder that stops refreshing loses it after this long"
    )
    settle_s: float | None = setting(None, "wait before claiming an empty lease (default: lease / 3)")
    max_candidates: int = setting(
        3, "stand for planner only among this many peers of smallest rank, or when nobody stands (0: always)"
    )

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {self.lease_s}")
        if self.settle_s is not None and self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")
        if self.max_candidates < 0:
            raise ValueError(f"max_candidates must be >= 0, got {self.max_candidates}")

    @property
    def refresh_s(self) -> float:
        return self.lease_s / 3

    @property
    def settle_delay_s(self) -> float:
        return self.refresh_s if self.settle_s is None else self.settle_s


class LeaseBoard(Protocol):
    """Where the lease records live (swarm.dht.directory.Directory), and the clock they are dated by."""

    @property
    def peer_id(self) -> str: ...

    @property
    def model_hash(self) -> str: ...

    @property
    def write_timeout_s(self) -> float: ...

    def now(self) -> float: ...

    async def read_leases(self) -> dict[str, LeaseRecord]: ...

    async def write_lease(self, lease: LeaseRecord, expiration: float) -> bool: ...


class Election:
    """Runs this peer's candidacy; `is_leader` says whether it holds the planner lease right now."""

    def __init__(
        self,
        directory: LeaseBoard,
        config: ElectionConfig | None = None,
        swarm: Callable[[], tuple[Collection[str], Mapping[str, LeaseRecord]] | None] | None = None,
    ) -> None:
        """``swarm``: the peer ids and lease records as last read (None before a first read); with it, this
        peer stands only where swarm.dht.lease.may_stand says so. Without it, it always stands."""
        self.directory = directory
        self.config = config or ElectionConfig()
        self.swarm = swarm
        self._standing = False  # whether our candidacy is in the DHT
        self.holder: str | None = None  # the lease holder as of our last read
        self._held_since: float | None = None
        self._last_write_ok = 0.0
        self.became_leader = asyncio.Event()

    @property
    def peer_id(self) -> str:
        return self.directory.peer_id

    @property
    def is_leader(self) -> bool:
        # A holder that cannot reach the DHT for a whole lease must assume it lost it.
        fresh = self.directory.now() - self._last_write_ok < self.config.lease_s
        return self._held_since is not None and fresh

    async def run(self) -> None:
        candidate_since = self.directory.now()
        try:
            while True:
                try:
                    if self.stands():
                        if not self._standing:
                            candidate_since = self.directory.now()
                        await self.tick(candidate_since)
                        self._standing = True
                    elif self._standing:  # others of smaller rank stand: leave the lease key to them
                        self._standing = False
                        await self._resign(candidate_since)
                except Exception as e:  # one bad round (a bad record, a DHT error) must not end the election
                    logger.warning("planner election round failed: %r", e)
                await asyncio.sleep(self.config.refresh_s)
        finally:
            if self._standing or self.swarm is None:
                await self._resign(candidate_since)

    def stands(self) -> bool:
        """Whether this peer stands for planner this round (the lease holder always does)."""
        if self.swarm is None or self._held_since is not None:
            return True
        seen = self.swarm()
        if seen is None:
            return False  # before a first read of the swarm: wait for it rather than crowd the lease key
        peer_ids, leases = seen
        return may_stand(
            self.peer_id, peer_ids, leases, self.config.max_candidates, self.directory.model_hash
        )

    async def tick(self, candidate_since: float) -> None:
        """One round: read the leases, decide, renew our record (run() calls it every refresh_s)."""
        now = self.directory.now()
        try:
            leases = await self.directory.read_leases()
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.warning("could not read planner leases: %r", e)
            return
        leases[self.peer_id] = self._record(candidate_since, now)  # our own view beats a stale read
        winner = decide(leases, now, self.config.settle_delay_s, self.directory.model_hash)
        if winner == self.peer_id and self._held_since is None:
            self._held_since = now
            logger.info("became the planner (lease holder)")
        elif winner != self.peer_id and self._held_since is not None:
            self._held_since = None
            self.became_leader.clear()
            logger.info("stepped down as planner: %s holds the lease", winner)
        self.holder = winner
        record = self._record(candidate_since, now)
        try:
            if await self.directory.write_lease(record, now + self.config.lease_s):
                self._last_write_ok = now
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.warning("could not write our planner lease: %r", e)
        if self.is_leader:
            self.became_leader.set()

    def _record(self, candidate_since: float, now: float, leaving: bool = False) -> LeaseRecord:
        return LeaseRecord(
            peer_id=self.peer_id,
            candidate_since=candidate_since,
            held_since=None if leaving else self._held_since,
            updated_at=now,
            leaving=leaving,
        )

    async def _resign(self, candidate_since: float) -> None:
        """Mark our candidacy leaving so others need not wait for it to expire."""
        was_leader, self._held_since = self._held_since is not None, None
        self.became_leader.clear()
        now = self.directory.now()
        try:
            async with asyncio.timeout(self.directory.write_timeout_s):
                record = self._record(candidate_since, now, leaving=True)
                # Must outlive our last refresh, or the DHT keeps the older (still claiming) value.
                await asyncio.shield(self.directory.write_lease(record, now + self.config.lease_s + 1.0))
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.warning("could not resign the planner lease (%r); it expires on its own", e)
        if was_leader:
            logger.info("resigned as planner")
