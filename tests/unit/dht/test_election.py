"""The planner-election rule as a pure function of lease records."""

from __future__ import annotations

import random

import pytest

from swarm.dht.election import ElectionConfig, decide, lease_holder
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
    import asyncio

    from swarm.dht.election import Election

    class Flaky:
        def __init__(self) -> None:
            self.reads = 0
            self.peer_id = "QmSelf"
            self.dht = type(
                "Dht", (), {"now": staticmethod(lambda: 1000.0), "model_hash": "h", "peer_id": "QmSelf"}
            )()

        async def read_leases(self) -> dict:  # type: ignore[type-arg]
            self.reads += 1
            if self.reads == 1:
                raise ValueError("a malformed lease slipped through")
            if self.reads >= 3:
                raise asyncio.CancelledError
            return {}

        async def write_lease(self, record: object, expiration: float) -> bool:
            return True

    directory = Flaky()

    async def body() -> None:
        election = Election(directory, ElectionConfig(lease_s=0.03, settle_s=0.0))  # type: ignore[arg-type]
        election._resign = lambda since: asyncio.sleep(0)  # type: ignore[method-assign]
        try:
            await election.run()
        except asyncio.CancelledError:
            pass

    asyncio.run(body())
    assert directory.reads >= 3, "the round after the failed one never ran"
