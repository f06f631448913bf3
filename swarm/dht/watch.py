"""Knowing the swarm without re-reading it: a small summary read often, the full records only when it changes.

The elected planner reads every record at its own pace anyway; after each look it writes a SummaryRecord: the
digest of the membership it read (who, in which state, holding which layers) and its plan's epoch
(swarm.peer.planner_service). Everyone else reads that one small record every ``poll_s`` from one of the nodes
that store it, and reads a full snapshot only when it changes. So an idle peer's reads do not grow with the
swarm, while joins, leaves, moves and new plans are seen within one poll of the planner's next look. The
planner writes the same summary under several keys in a large swarm (its ``copies``); each reader reads the
copy its own id picks (swarm.dht.schemas.summary_copy_of), and the first copy, which is always written, when
its own holds no summary of the holder (the number of copies changed, or it is just being written).

Trust: a summary only ever triggers a read; what is read is checked as always (swarm.dht.directory). Only the
summary of the lease holder named by our last full snapshot counts. Without one (no planner yet, the holder
changed, its summary expired), or when another writer's summary is newer than the holder's (a new holder, or
someone pretending to be one), we read the full snapshot every ``fallback_s``, as followers did before: a
hostile summary can make us read at that pace, no faster, and cannot hide a plan for long, since the holder
already decides the plan.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.dht.directory import Directory, SwarmSnapshot, membership_digest
from swarm.dht.schemas import SummaryRecord, summary_copy_of
from swarm.settings import positive, setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchConfig:
    """Watching the swarm for changes"""

    poll_s: float = setting(5.0, "how often to read the planner's small summary of the swarm")
    fallback_s: float = setting(5.0, "how often to read every record while no planner's summary is trusted")
    full_read_s: float = setting(0.0, "also read every record this often, summary or not (0: never)")

    def __post_init__(self) -> None:
        positive(self, "poll_s", "fallback_s")
        if self.full_read_s < 0:
            raise ValueError(f"full_read_s must be >= 0, got {self.full_read_s}")


def version_of(summary: SummaryRecord) -> tuple[str, int]:
    return summary.peers_digest, summary.plan_epoch


def snapshot_version(snapshot: SwarmSnapshot) -> tuple[str, int]:
    """A snapshot's membership digest and plan epoch, as a summary of it would say."""
    return membership_digest(snapshot.peers), snapshot.plan.epoch if snapshot.plan is not None else 0


def is_news(summary: SummaryRecord, known: SummaryRecord | None, snapshot: SwarmSnapshot) -> bool:
    """Whether ``summary`` tells of a membership or plan that neither the summary our snapshot answered
    (``known``) nor the snapshot itself shows."""
    if known is not None and version_of(known) == version_of(summary):
        return False
    return version_of(summary) != snapshot_version(snapshot)


def trusted_summary(
    summaries: dict[str, SummaryRecord], holder: str | None
) -> tuple[SummaryRecord | None, bool]:
    """The holder's summary, and whether another writer's is newer (then it cannot be relied on alone)."""
    mine = summaries.get(holder) if holder is not None else None
    if mine is None:
        return None, bool(summaries)
    newer = any(s.created_at > mine.created_at for pid, s in summaries.items() if pid != holder)
    return mine, newer


class SwarmWatch:
    """Keeps ``snapshot`` fresh by reading the planner's summary every poll_s and the records when it moved.

    ``on_snapshot`` callbacks see every full snapshot read (e.g. the peer's view of live peer ids)."""

    def __init__(
        self,
        directory: Directory,
        config: WatchConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.config = config or WatchConfig()
        self.clock = clock
        self.snapshot: SwarmSnapshot | None = None
        self.version = 0  # full snapshots read so far
        self.full_reads = 0
        self.summary_reads = 0
        self.thorough_reads = 0  # full reads made again from more nodes (a member the summary saw missed)
        self.on_snapshot: list[Callable[[SwarmSnapshot], None]] = []
        self._summary: SummaryRecord | None = None  # the trusted summary our snapshot is as new as
        self._read_at = float("-inf")  # clock of the last full read
        self._copies = 1  # summary copies the last summary we trusted was written under
        self._new = asyncio.Condition()
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as e:  # one failed read (a DHT timeout) must not stop watching
                logger.warning("watching the swarm failed (retrying in %.1f s): %r", self.config.poll_s, e)
            await asyncio.sleep(self.config.poll_s)

    async def tick(self) -> None:
        """One look: read the summary; read the records if it moved, or if no summary can be trusted and the
        fallback period has passed, or at the backstop period."""
        since = self.clock() - self._read_at
        if self.snapshot is None:
            await self.read()
            return
        summary, doubtful = await self._read_summary(self.snapshot.planner_peer_id)
        full_due = self.config.full_read_s > 0 and since >= self.config.full_read_s
        if summary is not None and not doubtful:
            if full_due or is_news(summary, self._summary, self.snapshot):
                await self.read(summary)
            else:
                self._summary = summary
            return
        if since >= self.config.fallback_s or full_due:
            await self.read()

    async def _read_summary(self, holder: str | None) -> tuple[SummaryRecord | None, bool]:
        """The holder's summary from our copy (and from the first if ours has none), and whether it is
        doubtful (see trusted_summary)."""
        copy = summary_copy_of(self.directory.peer_id, self._copies)
        summaries = await self.directory.read_summaries(copy)
        self.summary_reads += 1
        summary, doubtful = trusted_summary(summaries, holder)
        if summary is None and copy != 0:
            summaries = await self.directory.read_summaries(0)
            self.summary_reads += 1
            summary, doubtful = trusted_summary(summaries, holder)
        if summary is not None and not doubtful:
            self._copies = summary.copies
        return summary, doubtful

    async def read(self, summary: SummaryRecord | None = None) -> SwarmSnapshot:
        """A full snapshot now (as new as ``summary``, the trusted one that made us read, if any)."""
        async with self._lock:
            snapshot = await self.directory.snapshot()
            missed = summary is not None and membership_digest(snapshot.peers) != summary.peers_digest
            if missed:
                # The nodes we read from lack a record the planner saw (a store that reached only some of
                # them): once more, asking more nodes of every key.
                snapshot = await self.directory.snapshot(thorough=True)
                self.thorough_reads += 1
                assert summary is not None
                missed = membership_digest(snapshot.peers) != summary.peers_digest
            self._read_at = self.clock()
            self.full_reads += 1
            if (
                summary is None
                or missed  # still not what the planner saw: the summary stays news, so the next poll reads
                or summary.planner_peer_id != snapshot.planner_peer_id
                or (snapshot.plan.epoch if snapshot.plan is not None else 0) < summary.plan_epoch
            ):
                # Our first read, one without a trusted summary, or one that missed a member or the plan the
                # summary told of (a store that reached only some of its nodes): the next summary we trust is
                # news.
                summary = None
            self._summary = summary
            self.snapshot = snapshot
            for callback in self.on_snapshot:
                callback(snapshot)
        async with self._new:
            self.version += 1
            self._new.notify_all()
        return snapshot

    async def latest(self) -> SwarmSnapshot:
        """The newest snapshot (read now if there is none yet)."""
        if self.snapshot is None:
            return await self.read()
        return self.snapshot

    async def wait_newer(self, version: int, timeout_s: float) -> None:
        """Return once a snapshot newer than ``version`` was read, or after ``timeout_s``."""
        async with self._new:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._new.wait_for(lambda: self.version > version)
            except TimeoutError:
                pass
