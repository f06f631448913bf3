"""The planner lease's rule, as pure functions of lease records (swarm.dht.election runs it, the directory
reads the holder with it), and the lease period both default to."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from swarm.dht.schemas import LeaseRecord
from swarm.dht.trust import tie_rank

LEASE_S = 30.0  # the planner lease period: a holder that stops refreshing loses it after this long


def lease_holder(leases: Mapping[str, LeaseRecord], salt: str = "") -> str | None:
    """Rule 1: the earliest live claim holds the lease (ties: smallest tie_rank(peer id, salt))."""
    claims = [r for r in leases.values() if r.held_since is not None and not r.leaving]
    if not claims:
        return None
    return min(claims, key=lambda r: (r.held_since, tie_rank(r.peer_id, salt))).peer_id


def decide(leases: Mapping[str, LeaseRecord], now: float, settle_s: float, salt: str = "") -> str | None:
    """Who should hold the lease given the live lease records (pure: same records, same answer).

    `salt` is the model hash: every candidate of one swarm ranks the others the same way."""
    holder = lease_holder(leases, salt)
    if holder is not None:
        return holder
    candidates = [r for r in leases.values() if not r.leaving]
    if not candidates:
        return None
    first = min(candidates, key=lambda r: tie_rank(r.peer_id, salt))
    return first.peer_id if now - first.candidate_since >= settle_s else None


def may_stand(
    peer_id: str,
    peer_ids: Collection[str],
    leases: Mapping[str, LeaseRecord],
    max_candidates: int,
    salt: str = "",
) -> bool:
    """Whether ``peer_id`` should stand for planner: it is among the ``max_candidates`` peers of smallest
    rank of ``peer_ids`` (the swarm as last read), or nobody stands now (no live candidacy in ``leases``), or
    ``max_candidates`` is 0 (everyone stands). Few candidates keep the lease key, which every candidate
    reads each lease_s / 3, small however large the swarm."""
    if max_candidates == 0:
        return True
    standing = [r for r in leases.values() if not r.leaving]
    if not any(r.peer_id != peer_id for r in standing):
        return True
    ranked = sorted({*peer_ids, peer_id}, key=lambda pid: tie_rank(pid, salt))
    return peer_id in ranked[:max_candidates]
