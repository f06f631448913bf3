"""The swarm directory: announce this peer, read a typed snapshot of everyone, publish the plan.

Every value read back is checked three times: hivemind verified the RSA signature of its subkey, the schema
validator checked its shape on the storing node, and here we parse it with the strict pydantic model and
require its peer id to be the one the signing key hashes to. Anything failing is skipped, never trusted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic

from swarm.dht.election import lease_holder
from swarm.dht.identity import owner_peer_id
from swarm.dht.node import SwarmDHT
from swarm.dht.schemas import LeaseRecord, PeerRecord, PlanRecord, lease_key, peers_key, plan_key
from swarm.types import LayerRange
from swarm.types import coverage as layer_coverage

logger = logging.getLogger(__name__)

R = TypeVar("R", PeerRecord, PlanRecord, LeaseRecord)


@dataclass(frozen=True)
class DirectoryConfig:
    """Lifetimes of the records this peer writes."""

    ttl_s: float = 30.0  # a peer record vanishes this long after its writer stops refreshing it
    plan_ttl_s: float = 300.0  # a plan outlives its planner long enough for a successor to take over
    read_timeout_s: float = 15.0  # deadline of one snapshot read
    write_timeout_s: float = 5.0  # deadline of one announcement or withdrawal

    def __post_init__(self) -> None:
        if min(self.ttl_s, self.plan_ttl_s, self.read_timeout_s, self.write_timeout_s) <= 0:
            raise ValueError("ttl_s, plan_ttl_s, read_timeout_s and write_timeout_s must be positive")

    @property
    def refresh_s(self) -> float:
        """How often a writer refreshes its record: three chances before it expires."""
        return self.ttl_s / 3


@dataclass(frozen=True)
class SwarmSnapshot:
    """What the DHT said at `fetched_at`: live, valid, correctly signed records only."""

    peers: Mapping[str, PeerRecord]  # by peer id, any state ("loading", "serving", "leaving")
    plan: PlanRecord | None
    planner_peer_id: str | None  # the current planner-lease holder
    fetched_at: float  # DHT time (unix seconds)
    leases: Mapping[str, LeaseRecord] = field(default_factory=dict)

    def serving(self) -> dict[str, PeerRecord]:
        return {pid: r for pid, r in self.peers.items() if r.state == "serving"}


def coverage(snapshot: SwarmSnapshot, num_layers: int) -> list[int]:
    """How many serving peers hold each layer (a 0 means no route can exist)."""
    held = (
        LayerRange(r.range_start, r.range_end)
        for r in snapshot.serving().values()
        if r.range_end > r.range_start  # a record may hold nothing yet
    )
    return layer_coverage(held, num_layers)


def parse_records(raw: Mapping[Any, tuple[Any, float]], model: type[R], what: str) -> dict[str, R]:
    """Validated records keyed by the signer's peer id; a record naming another peer id is dropped."""
    records: dict[str, R] = {}
    for subkey, (value, _expiration) in raw.items():
        signer = owner_peer_id(subkey)
        try:
            record = model.from_dht(value)
        except pydantic.ValidationError as e:
            logger.debug("skipping invalid %s record from %s: %s", what, signer, e)
            continue
        claimed = record.planner_peer_id if isinstance(record, PlanRecord) else record.peer_id
        if signer is None or claimed != signer:
            logger.debug("skipping %s record for %s signed by %s", what, claimed, signer)
            continue
        records[signer] = record
    return records


def pick_plan(plans: Mapping[str, PlanRecord], planner_peer_id: str | None) -> PlanRecord | None:
    """The newest epoch; on a tie the current planner's copy, then the most recent one."""
    if not plans:
        return None
    return max(plans.values(), key=lambda p: (p.epoch, p.planner_peer_id == planner_peer_id, p.created_at))


class Directory:
    """Reads and writes this model's records in the DHT (the only typed door to them)."""

    def __init__(self, dht: SwarmDHT, config: DirectoryConfig | None = None) -> None:
        self.dht = dht
        self.config = config or DirectoryConfig()
        self._last_record: PeerRecord | None = None
        self._last_expiration = 0.0

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

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
        stored = await self.dht.store(
            peers_key(self.dht.model_hash), self.dht.own_subkey(), record.to_dht(), expiration
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
        await self.dht.store(
            peers_key(self.dht.model_hash), self.dht.own_subkey(), leaving.to_dht(), expiration
        )
        self._last_record = None
        logger.info("withdrew from the directory")

    async def publish_plan(self, plan: PlanRecord) -> bool:
        """Store a plan under our own subkey; only the elected planner should call this."""
        if plan.planner_peer_id != self.dht.peer_id:
            raise ValueError(
                f"plan names planner {plan.planner_peer_id}, but this node is {self.dht.peer_id}"
            )
        expiration = self.dht.now() + self.config.plan_ttl_s
        return await self.dht.store(
            plan_key(self.dht.model_hash), self.dht.own_subkey(), plan.to_dht(), expiration
        )

    async def write_lease(self, lease: LeaseRecord, expiration: float) -> bool:
        if lease.peer_id != self.dht.peer_id:
            raise ValueError(f"lease is for {lease.peer_id}, but this node is {self.dht.peer_id}")
        return await self.dht.store(
            lease_key(self.dht.model_hash), self.dht.own_subkey(), lease.to_dht(), expiration
        )

    async def read_peers(self) -> dict[str, PeerRecord]:
        raw = await self.dht.get(peers_key(self.dht.model_hash))
        peers = parse_records(raw, PeerRecord, "peer")
        return {pid: r for pid, r in peers.items() if r.model_hash == self.dht.model_hash}

    async def read_plans(self) -> dict[str, PlanRecord]:
        return parse_records(await self.dht.get(plan_key(self.dht.model_hash)), PlanRecord, "plan")

    async def read_leases(self) -> dict[str, LeaseRecord]:
        return parse_records(await self.dht.get(lease_key(self.dht.model_hash)), LeaseRecord, "lease")

    async def snapshot(self) -> SwarmSnapshot:
        """One consistent-enough view: peers, leases and plans read concurrently, with a deadline."""
        async with asyncio.timeout(self.config.read_timeout_s):
            peers, plans, leases = await asyncio.gather(
                self.read_peers(), self.read_plans(), self.read_leases()
            )
        holder = lease_holder(leases)
        return SwarmSnapshot(
            peers=peers,
            plan=pick_plan(plans, holder),
            planner_peer_id=holder,
            fetched_at=self.dht.now(),
            leases=leases,
        )


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
