"""The planner-election rule as a pure function of lease records, and elections run on an injected clock."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from swarm.dht.election import Election, ElectionConfig
from swarm.dht.lease import decide, lease_holder, may_stand
from swarm.dht.schemas import LeaseRecord
from swarm.dht.trust import tie_rank

pytestmark = pytest.mark.timeout(10)


def lease(pid: str, since: float = 0.0, held: float | None = None, leaving: bool = False) -> LeaseRecord:
    return LeaseRecord(peer_id=pid, candidate_since=since, held_since=held, updated_at=since, leaving=leaving)


def table(*records: LeaseRecord) -> dict[str, LeaseRecord]:
    return {r.peer_id: r for r in records}


def test_no_candidates_no_winner():
    assert decide({}, now=100.0, settle_s=5.0) is None


def by_rank(*pids: str, salt: str = "") -> list[str]:
    return sorted(pids, key=lambda pid: tie_rank(pid, salt))


def test_smallest_rank_wins_an_empty_lease_after_settling():
    first, second, third = by_rank("QmA", "QmB", "QmC")
    leases = table(lease(third, 0.0), lease(first, 98.0), lease(second, 0.0))
    assert decide(leases, now=100.0, settle_s=5.0) is None  # the first has not settled: nobody claims yet
    assert decide(leases, now=103.0, settle_s=5.0) == first


def test_ranks_depend_on_the_model_hash():
    # The salt is the model hash: a key ground to win one swarm's ties has no edge in another's.
    pids = [f"Qm{i}" for i in range(20)]
    assert by_rank(*pids, salt="model-a") != by_rank(*pids, salt="model-b")
    assert tie_rank("QmA", "m") == tie_rank("QmA", "m")


def test_holder_keeps_the_lease_against_better_ranks():
    best, worst = by_rank("QmA", "QmB")
    leases = table(lease(worst, 0.0, held=10.0), lease(best, 0.0))
    assert decide(leases, now=100.0, settle_s=5.0) == worst


def test_split_claims_resolve_to_the_earliest_holder():
    leases = table(lease("QmA", 0.0, held=20.0), lease("QmB", 0.0, held=10.0))
    assert lease_holder(leases) == "QmB"
    tied = table(lease("QmB", 0.0, held=10.0), lease("QmA", 0.0, held=10.0))
    assert lease_holder(tied, salt="s") == by_rank("QmA", "QmB", salt="s")[0]


def test_leaving_records_are_ignored():
    leases = table(lease("QmA", 0.0, held=10.0, leaving=True), lease("QmB", 0.0))
    assert decide(leases, now=100.0, settle_s=5.0) == "QmB"
    assert decide(table(lease("QmA", leaving=True)), now=100.0, settle_s=0.0) is None


R1, R2, R3 = by_rank("QmK", "QmM", "QmZ")  # best rank first
AGREEMENT_CASES: dict[str, tuple[list[LeaseRecord], str | None]] = {
    "empty lease: best settled rank": ([lease(R3, 0.0), lease(R2, 0.0), lease(R1, 50.0)], R1),
    "empty lease: best rank not settled yet": ([lease(R2, 0.0), lease(R1, 95.0)], None),
    "claims tied in time: best rank": (
        [lease(R3, 0.0, held=10.0), lease(R1, 0.0, held=10.0), lease(R2, 0.0, held=10.0)],
        R1,
    ),
    "earliest claim beats a better rank": (
        [lease(R1, 0.0, held=20.0), lease(R3, 0.0, held=10.0), lease(R2, 0.0)],
        R3,
    ),
    "leaving holder ignored": (
        [lease("QmA", 0.0, held=5.0, leaving=True), lease("QmD", 0.0, held=30.0), lease("QmB", 0.0)],
        "QmD",
    ),
}


@pytest.mark.parametrize("case", sorted(AGREEMENT_CASES))
def test_everyone_agrees_on_the_same_records(case: str):
    # Peers read the same records in whatever order the DHT returns them: shuffle, so that a rule that
    # depends on order (say, "the first claim wins") fails here. Seeded per case, so a failure replays.
    records, expected = AGREEMENT_CASES[case]
    rng = random.Random(f"election {case}")
    views = []
    for _ in range(12):
        shuffled = list(records)
        rng.shuffle(shuffled)
        views.append(table(*shuffled))
    assert {decide(view, now=100.0, settle_s=10.0) for view in views} == {expected}


def test_config_checks():
    assert ElectionConfig(lease_s=3.0).settle_delay_s == 1.0
    with pytest.raises(ValueError):
        ElectionConfig(lease_s=0.0)


def test_a_failed_election_round_does_not_end_the_election() -> None:
    """A round that raises (here: the lease read fails with an unexpected error) is logged; the next runs."""

    class Flaky(Board):
        async def read_leases(self) -> dict[str, LeaseRecord]:
            self.reads += 1
            if self.reads == 1:
                raise ValueError("a malformed lease slipped through")
            if self.reads >= 3:
                raise asyncio.CancelledError
            return {}

    board = Flaky(Store(), "QmSelf")

    async def body() -> None:
        election = Election(board, ElectionConfig(lease_s=0.03, settle_s=0.0))
        election._resign = lambda since: asyncio.sleep(0)  # type: ignore[method-assign]
        try:
            await election.run()
        except asyncio.CancelledError:
            pass

    asyncio.run(body())
    assert board.reads >= 3, "the round after the failed one never ran"


# ---- elections on an in-memory lease store and a clock the test moves --------------------------------


@dataclass
class Store:
    """The lease key of a DHT: one record per peer, kept until its expiration (DHT time, moved by the test)."""

    time: float = 1000.0
    records: dict[str, tuple[LeaseRecord, float]] = field(default_factory=dict)

    def live(self) -> dict[str, LeaseRecord]:
        return {pid: r for pid, (r, expiration) in self.records.items() if expiration > self.time}


@dataclass
class Board:
    """One peer's view of the store (what swarm.dht.election.LeaseBoard asks for)."""

    store: Store
    peer_id: str
    model_hash: str = "model"
    write_timeout_s: float = 5.0
    reads: int = 0

    def now(self) -> float:
        return self.store.time

    async def read_leases(self) -> dict[str, LeaseRecord]:
        self.reads += 1
        return self.store.live()

    async def write_lease(self, lease: LeaseRecord, expiration: float) -> bool:
        held = self.store.records.get(lease.peer_id)
        if held is None or expiration >= held[1]:  # the DHT keeps the value that expires last
            self.store.records[lease.peer_id] = (lease, expiration)
        return True


async def _rounds(store: Store, elections: dict[str, Election], since: float, rounds: int) -> list[set[str]]:
    """Every election ticks once per refresh period; the leaders after each round."""
    leaders = []
    for _ in range(rounds):
        for election in elections.values():
            await election.tick(since)
        leaders.append({pid for pid, e in elections.items() if e.is_leader})
        store.time += ElectionConfig(lease_s=LEASE).refresh_s
    return leaders


LEASE = 30.0


def test_one_leader_stays_and_a_successor_claims_within_two_leases_of_its_death() -> None:
    async def body() -> None:
        store = Store()
        pids = by_rank("QmA", "QmB", "QmC")
        config = ElectionConfig(lease_s=LEASE)
        elections = {pid: Election(Board(store, pid, "model"), config) for pid in pids}
        since = store.time

        # Nobody claims before the candidacies settled (settle_s = lease / 3 = one round), then exactly one.
        leaders = await _rounds(store, elections, since, rounds=2)
        assert leaders[0] == set()
        assert len(leaders[1]) == 1
        (leader,) = leaders[1]

        # Renewals keep the lease with the same holder for many lease periods, even against a newcomer that
        # ranks better (leadership is sticky).
        newcomer = next(
            f"QmN{i}" for i in range(1000) if by_rank(f"QmN{i}", leader, salt="model")[0] != leader
        )
        elections[newcomer] = Election(Board(store, newcomer, "model"), config)
        later = await _rounds(store, elections, since, rounds=12)
        assert all(held == {leader} for held in later)
        assert {e.holder for e in elections.values()} == {leader}

        # The leader dies (stops refreshing, never resigns): one successor, no later than two leases on.
        died_at = store.time
        del elections[leader]
        while not any(e.is_leader for e in elections.values()):
            assert store.time - died_at <= 2 * LEASE, "no successor within two lease periods"
            await _rounds(store, elections, since, rounds=1)
        assert len([e for e in elections.values() if e.is_leader]) == 1
        assert leader not in store.live()  # nobody claimed while the dead holder's record was live

    asyncio.run(body())


def test_a_leader_that_cannot_write_for_a_lease_stops_calling_itself_leader() -> None:
    async def body() -> None:
        store = Store()

        class Cut(Board):
            cut = False

            async def write_lease(self, lease: LeaseRecord, expiration: float) -> bool:
                if self.cut:
                    raise OSError("unreachable")
                return await super().write_lease(lease, expiration)

        board = Cut(store, "QmA")
        election = Election(board, ElectionConfig(lease_s=LEASE, settle_s=0.0))
        await election.tick(store.time)
        assert election.is_leader
        board.cut = True
        store.time += LEASE - 1.0
        assert election.is_leader  # within a lease of its last renewal it may still hold the lease
        store.time += 1.0
        assert not election.is_leader

    asyncio.run(body())


def test_only_the_few_of_smallest_rank_stand_unless_nobody_does():
    pids = by_rank(*(f"Qm{i}" for i in range(10)), salt="m")
    standing = table(*(lease(pid) for pid in pids[:3]))
    # Among the 3 of smallest rank: stand; the others leave the lease key to them.
    assert all(may_stand(pid, pids, standing, 3, "m") for pid in pids[:3])
    assert not any(may_stand(pid, pids, standing, 3, "m") for pid in pids[3:])
    # Nobody stands (every candidacy resigned or expired): anyone stands.
    resigned = table(*(lease(pid, leaving=True) for pid in pids[:3]))
    assert all(may_stand(pid, pids, resigned, 3, "m") for pid in pids)
    assert all(may_stand(pid, pids, {}, 3, "m") for pid in pids)
    # 0: everyone stands; a peer missing from the read it ranks itself into.
    assert may_stand(pids[-1], pids, standing, 0, "m")
    assert may_stand(pids[0], pids[1:], standing, 3, "m")


def test_a_peer_of_large_rank_writes_no_lease_while_others_stand() -> None:
    async def body() -> None:
        store = Store()
        pids = by_rank(*(f"Qm{i}" for i in range(4)), salt="model")
        config = ElectionConfig(lease_s=LEASE, max_candidates=1)
        first = Election(Board(store, pids[0], "model"), config)
        await first.tick(store.time)
        seen = (pids, store.live())
        last = Election(Board(store, pids[-1], "model"), config, swarm=lambda: seen)
        assert first.stands() and not last.stands()
        runs = asyncio.ensure_future(last.run())
        await asyncio.sleep(0)
        runs.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runs
        assert pids[-1] not in store.live()  # never wrote a candidacy, so nothing to resign either

    asyncio.run(body())
