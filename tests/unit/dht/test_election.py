"""The planner-election rule as a pure function of lease records."""

from __future__ import annotations

import random

import pytest

from swarm.dht.election import ElectionConfig, decide, lease_holder
from swarm.dht.schemas import LeaseRecord

pytestmark = pytest.mark.timeout(10)


def lease(pid: str, since: float = 0.0, held: float | None = None, leaving: bool = False) -> LeaseRecord:
    return LeaseRecord(peer_id=pid, candidate_since=since, held_since=held, updated_at=since, leaving=leaving)


def table(*records: LeaseRecord) -> dict[str, LeaseRecord]:
    return {r.peer_id: r for r in records}


def test_no_candidates_no_winner():
    assert decide({}, now=100.0, settle_s=5.0) is None


def test_smallest_id_wins_an_empty_lease_after_settling():
    leases = table(lease("QmC", 0.0), lease("QmA", 98.0), lease("QmB", 0.0))
    assert decide(leases, now=100.0, settle_s=5.0) is None  # QmA has not settled: nobody claims yet
    assert decide(leases, now=103.0, settle_s=5.0) == "QmA"


def test_holder_keeps_the_lease_against_smaller_ids():
    leases = table(lease("QmB", 0.0, held=10.0), lease("QmA", 0.0))
    assert decide(leases, now=100.0, settle_s=5.0) == "QmB"


def test_split_claims_resolve_to_the_earliest_holder():
    leases = table(lease("QmA", 0.0, held=20.0), lease("QmB", 0.0, held=10.0))
    assert lease_holder(leases) == "QmB"
    tied = table(lease("QmB", 0.0, held=10.0), lease("QmA", 0.0, held=10.0))
    assert lease_holder(tied) == "QmA"


def test_leaving_records_are_ignored():
    leases = table(lease("QmA", 0.0, held=10.0, leaving=True), lease("QmB", 0.0))
    assert decide(leases, now=100.0, settle_s=5.0) == "QmB"
    assert decide(table(lease("QmA", leaving=True)), now=100.0, settle_s=0.0) is None


AGREEMENT_CASES: dict[str, tuple[list[LeaseRecord], str | None]] = {
    "empty lease: smallest settled id": ([lease("QmZ", 0.0), lease("QmM", 0.0), lease("QmK", 50.0)], "QmK"),
    "empty lease: smallest id not settled yet": ([lease("QmB", 0.0), lease("QmA", 95.0)], None),
    "claims tied in time: smallest id": (
        [lease("QmC", 0.0, held=10.0), lease("QmA", 0.0, held=10.0), lease("QmB", 0.0, held=10.0)],
        "QmA",
    ),
    "earliest claim beats a smaller id": (
        [lease("QmA", 0.0, held=20.0), lease("QmC", 0.0, held=10.0), lease("QmB", 0.0)],
        "QmC",
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
