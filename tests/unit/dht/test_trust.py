"""What a DHT reader believes: record bounds, times, the lease holder's plan only, epochs, leases, reports.

The Directory runs over an in-memory DHT whose subkeys carry real RSA owner markers (so the signer check is
the real one); every attack here is a value anyone could store under a key of their own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pydantic
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from swarm.dht import Directory, DirectoryConfig, ModelShape, ReportRecord
from swarm.dht.directory import CONFIRM_ASK, parse_records
from swarm.dht.identity import load_private_key, peer_id_of_public_key
from swarm.dht.lease import lease_holder
from swarm.dht.schemas import (
    PEER_SHARDS,
    LeaseRecord,
    LinkMeasure,
    PeerRecord,
    PlanRecord,
    lease_key,
    peers_key,
    plan_key,
    record_key,
    reports_key,
    shard_of,
)
from swarm.dht.trust import EpochGuard, LeaseWitness, Rejections, plan_problem, time_problem
from swarm.types import LayerRange, NodeID, Plan
from tests.unit.dht.records import MODEL_HASH, peer_record

pytestmark = pytest.mark.timeout(60)
NOW = 1_700_000_000.0


class Key:
    def __init__(self, tmp_path: Any, name: str) -> None:
        path = tmp_path / f"{name}.key"
        P2P.generate_identity(str(path))
        key = load_private_key(path)
        self.peer_id = peer_id_of_public_key(key.get_public_key())
        self.subkey = RSASignatureValidator(key).local_public_key


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> list[Key]:
    tmp = tmp_path_factory.mktemp("trust-keys")
    return [Key(tmp, f"k{i}") for i in range(4)]


class MemoryDHT:
    """The SwarmDHT surface Directory uses, over a dict, at a fixed clock."""

    def __init__(self, me: Key) -> None:
        self.model_hash = MODEL_HASH
        self.peer_id = me.peer_id
        self._subkey = me.subkey
        self.clock = NOW
        self.data: dict[str, dict[bytes, tuple[Any, float]]] = {}
        self.reads: list[tuple[tuple[str, ...], int]] = []  # (keys, ask) of each read_near

    def now(self) -> float:
        return self.clock

    def own_subkey(self) -> bytes:
        return self._subkey

    def put(self, key: str, subkey: bytes, value: Any, expiration: float = NOW + 30) -> None:
        self.data.setdefault(key, {})[subkey] = (value, expiration)

    async def store(self, key: str, subkey: bytes, value: Any, expiration: float) -> bool:
        self.put(key, subkey, value, expiration)
        return True

    async def get(self, key: str) -> dict[bytes, tuple[Any, float]]:
        return {k: v for k, v in self.data.get(key, {}).items() if v[1] > self.clock}

    async def read_near(self, keys: Any, ask: int = 1) -> dict[str, dict[bytes, tuple[Any, float]]]:
        self.reads.append((tuple(keys), ask))
        return {key: await self.get(key) for key in keys}


def plan_value(planner: str, placement: dict[str, LayerRange], epoch: int) -> dict[str, Any]:
    plan = Plan("milp", {NodeID(p): r for p, r in placement.items()}, 10.0, epoch=epoch)
    return PlanRecord(epoch=epoch, planner_peer_id=planner, plan=plan.to_json(), created_at=NOW).to_dht()


def lease_value(pid: str, since: float, held: float | None) -> dict[str, Any]:
    return LeaseRecord(peer_id=pid, candidate_since=since, held_since=held, updated_at=NOW).to_dht()


def swarm(keys: list[Key]) -> tuple[MemoryDHT, Directory]:
    """keys[0] reads; keys[1] holds 0:4, keys[2] 4:8 and the planner lease, with a plan of epoch 3."""
    dht = MemoryDHT(keys[0])
    a, b = keys[1], keys[2]
    dht.put(
        record_key(MODEL_HASH, a.peer_id), a.subkey, peer_record(a.peer_id, 0, 4, updated_at=NOW).to_dht()
    )
    dht.put(
        record_key(MODEL_HASH, b.peer_id), b.subkey, peer_record(b.peer_id, 4, 8, updated_at=NOW).to_dht()
    )
    dht.put(lease_key(MODEL_HASH), b.subkey, lease_value(b.peer_id, NOW - 100, NOW - 90))
    placement = {a.peer_id: LayerRange(0, 4), b.peer_id: LayerRange(4, 8)}
    dht.put(plan_key(MODEL_HASH), b.subkey, plan_value(b.peer_id, placement, 3))
    return dht, Directory(dht, shape=ModelShape(8, 64))  # type: ignore[arg-type]


def read(directory: Directory) -> Any:
    return asyncio.run(directory.snapshot())


# ------------------------------------------------------------------------------------------------ bounds


@pytest.mark.parametrize(
    "changes",
    [
        {"decode_layer_tokens_s_b8": float("inf")},
        {"decode_layer_tokens_s_b1": float("nan")},
        {"prefill_layer_tokens_s": 1e12},
        {"max_layers": 9},  # more than the model's 8
        {"free_cache_tokens": 5000},  # more than cache_tokens_total
        {"cache_tokens_total": 1 << 40, "free_cache_tokens": 0},
        {"num_layers": 10**6},
        {"updated_at": float("inf")},
        {"links": {"QmX": {"rtt_s": 0.01, "bandwidth_bytes_s": float("inf")}}},
        {"links": {f"Qm{i}": {"rtt_s": 0.01, "bandwidth_bytes_s": 1e9} for i in range(65)}},
        {"maddrs": ["x" * 300]},
    ],
)
def test_peer_records_out_of_bounds_are_invalid(changes: dict[str, Any]) -> None:
    value = peer_record("QmA").to_dht() | changes
    with pytest.raises(pydantic.ValidationError):
        PeerRecord.from_dht(value)


def test_link_bounds() -> None:
    with pytest.raises(pydantic.ValidationError):
        LinkMeasure(rtt_s=3600.0, bandwidth_bytes_s=1e9)


def _plan_dict(**changes: Any) -> dict[str, Any]:
    body = Plan("milp", {NodeID("QmA"): LayerRange(0, 4)}, 10.0, epoch=3).to_json() | changes
    return {"epoch": body["epoch"], "planner_peer_id": "QmA", "plan": body, "created_at": NOW}


@pytest.mark.parametrize(
    "changes",
    [
        {"placement": [["QmA", 0, 4]]},  # a list, not a dict
        {"placement": {"QmA": [4, 2]}},  # an empty range
        {"placement": {"QmA": [0, 1, 2]}},
        {"placement": {"QmA": [-1, 2]}},
        {"max_flow_tokens_s": float("inf")},
        {"flows": [{"src": "source", "dst": "QmA", "tokens_s": float("nan")}]},
        {"epoch": 2**62},
        {"epoch": 2**64 - 1},
        {"placement": {f"Qm{i}": [0, 1] for i in range(1025)}},
        {"surprise": 1},
    ],
)
def test_malformed_plans_are_invalid(changes: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        PlanRecord.from_dht(_plan_dict(**changes))


def test_plan_record_epoch_must_match_its_body() -> None:
    value = _plan_dict()
    with pytest.raises(pydantic.ValidationError):
        PlanRecord.from_dht(value | {"epoch": 4})
    assert PlanRecord.from_dht(value).to_plan().placement == {"QmA": LayerRange(0, 4)}


def test_bad_records_are_dropped_counted_and_logged_once(keys: list[Key], caplog: Any) -> None:
    a = keys[1]
    raw = {a.subkey: (_plan_dict(placement=[["x", 0, 1]]) | {"planner_peer_id": a.peer_id}, NOW + 30)}
    rejections = Rejections()
    with caplog.at_level(logging.WARNING, logger="swarm.dht.trust"):
        for _ in range(5):
            assert parse_records(raw, PlanRecord, "plan", rejections=rejections) == {}
    assert rejections.counts["plan"] == 5
    assert len([r for r in caplog.records if "dropping plan record" in r.message]) == 1


# ------------------------------------------------------------------------------------------------ time


def test_records_from_the_future_or_living_too_long_are_dropped() -> None:
    record = peer_record("QmA", updated_at=NOW)
    assert time_problem(record, NOW + 30, NOW, max_ttl_s=900) is None
    assert "future" in (time_problem(peer_record("QmA", updated_at=NOW + 3600), NOW + 30, NOW, 900) or "")
    assert "expires" in (time_problem(record, NOW + 10**6, NOW, 900) or "")
    lease = LeaseRecord(peer_id="QmA", candidate_since=NOW + 3600, held_since=None, updated_at=NOW)
    assert "future" in (time_problem(lease, NOW + 30, NOW, 900) or "")


def test_directory_drops_a_record_stored_to_live_forever(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    forever = keys[3]
    value = peer_record(forever.peer_id, 0, 8, updated_at=NOW).to_dht()
    dht.put(record_key(MODEL_HASH, forever.peer_id), forever.subkey, value, expiration=NOW + 10**7)
    assert forever.peer_id not in read(directory).peers
    assert directory.rejections.counts["peer"] == 1


def test_a_record_stored_in_another_peers_shard_is_dropped(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    stray = keys[3]
    wrong = peers_key(MODEL_HASH, (shard_of(stray.peer_id) + 1) % PEER_SHARDS)
    dht.put(wrong, stray.subkey, peer_record(stray.peer_id, 0, 8, updated_at=NOW).to_dht())
    assert stray.peer_id not in read(directory).peers
    assert directory.rejections.counts["peer"] == 1
    dht.put(
        record_key(MODEL_HASH, stray.peer_id),
        stray.subkey,
        peer_record(stray.peer_id, 0, 8, updated_at=NOW).to_dht(),
    )
    assert stray.peer_id in read(directory).peers


def test_a_record_gone_before_its_expiry_is_asked_of_more_nodes(keys: list[Key]) -> None:
    """One node answering without a live record (it missed the store, or withholds it) does not make the
    peer vanish: the key is read again from more nodes. A record past its expiry is simply gone."""
    dht, directory = swarm(keys)
    a = keys[1]
    read(directory)
    read(directory)
    # The first read asks more nodes of every key (nothing to compare with yet), the next one.
    assert [ask for _keys, ask in dht.reads] == [1 + CONFIRM_ASK, 1]
    first = len(dht.reads)
    key = record_key(MODEL_HASH, a.peer_id)
    held = dht.data[key].pop(a.subkey)
    asked_again = []

    async def one_node_missed_it(keys_: Any, ask: int = 1) -> dict[str, dict[bytes, tuple[Any, float]]]:
        found = {k: await dht.get(k) for k in keys_}
        if ask > 1:
            asked_again.extend(keys_)
            found[key] = {**found[key], a.subkey: held}
        return found

    dht.read_near = one_node_missed_it  # type: ignore[method-assign]
    assert a.peer_id in read(directory).peers
    assert asked_again == [key]
    dht.clock = held[1] + 1  # expired: no second read, and the peer is gone
    asked_again.clear()
    assert a.peer_id not in read(directory).peers
    assert asked_again == [] and first == 2


def test_the_model_shape_comes_from_the_spec_not_from_a_record(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    odd = keys[3]
    value = peer_record(odd.peer_id, 0, 2, num_layers=2, max_layers=2, updated_at=NOW).to_dht()
    dht.put(record_key(MODEL_HASH, odd.peer_id), odd.subkey, value)
    assert set(read(directory).peers) == {keys[1].peer_id, keys[2].peer_id}


# ------------------------------------------------------------------------------------------------ plans


def test_a_forged_plan_from_a_non_leader_is_ignored(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    forger, a, b = keys[3], keys[1], keys[2]
    forged = plan_value(forger.peer_id, {a.peer_id: LayerRange(0, 1), b.peer_id: LayerRange(0, 1)}, 10**15)
    dht.put(plan_key(MODEL_HASH), forger.subkey, forged)
    snapshot = read(directory)
    assert snapshot.planner_peer_id == b.peer_id
    assert (
        snapshot.plan is not None and snapshot.plan.epoch == 3 and snapshot.plan.planner_peer_id == b.peer_id
    )


def test_the_holders_plan_must_fit_the_snapshot(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    a, b = keys[1], keys[2]
    unknown = plan_value(b.peer_id, {a.peer_id: LayerRange(0, 4), "QmNobody": LayerRange(4, 8)}, 4)
    dht.put(plan_key(MODEL_HASH), b.subkey, unknown)
    assert read(directory).plan is None
    too_many = plan_value(b.peer_id, {a.peer_id: LayerRange(0, 8)}, 4)  # a announced max_layers 8: fits
    dht.put(
        record_key(MODEL_HASH, a.peer_id),
        a.subkey,
        peer_record(a.peer_id, 0, 4, max_layers=3, updated_at=NOW).to_dht(),
    )
    dht.put(plan_key(MODEL_HASH), b.subkey, too_many)
    assert read(directory).plan is None
    assert directory.rejections.counts["plan"] == 2


def test_plan_problem_checks_layers_against_the_model() -> None:
    peers = {"QmA": peer_record("QmA", num_layers=8, max_layers=8)}
    plan = PlanRecord.from_dht(_plan_dict(placement={"QmA": [0, 8]}))
    assert plan_problem(plan, peers, num_layers=8) is None
    assert "past the model" in (plan_problem(plan, peers, num_layers=6) or "")


def test_epochs_cannot_jump(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    a, b = keys[1], keys[2]
    placement = {a.peer_id: LayerRange(0, 4), b.peer_id: LayerRange(4, 8)}
    assert read(directory).plan.epoch == 3  # type: ignore[union-attr]
    dht.put(plan_key(MODEL_HASH), b.subkey, plan_value(b.peer_id, placement, 10**15))
    assert read(directory).plan is None  # even from the lease holder
    dht.put(plan_key(MODEL_HASH), b.subkey, plan_value(b.peer_id, placement, 4))
    assert read(directory).plan.epoch == 4  # type: ignore[union-attr]
    assert directory.accepted_epoch == 4


def test_epoch_guard_allows_one_per_second_after_some_slack() -> None:
    guard = EpochGuard()
    assert guard.problem(10**9, NOW) is None  # a fresh reader has nothing to compare with
    guard.accept(10, NOW)
    assert guard.problem(12, NOW) is None and guard.problem(13, NOW) is not None
    assert guard.problem(22, NOW + 10.0) is None and guard.problem(23, NOW + 10.0) is not None
    assert guard.problem(5, NOW) is None  # older epochs are the follower's business (it ignores them)


# ------------------------------------------------------------------------------------------------ leases


def test_a_backdated_claim_does_not_displace_the_witnessed_holder(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    holder, thief = keys[2], keys[3]
    assert read(directory).planner_peer_id == holder.peer_id
    dht.clock = NOW + 5  # the holder claimed at NOW - 90: more than a lease (30 s) before the theft
    dht.put(lease_key(MODEL_HASH), thief.subkey, lease_value(thief.peer_id, 0.0, 0.0))
    for _ in range(3):
        assert read(directory).planner_peer_id == holder.peer_id
        dht.clock += 1.0


def test_witness_clamps_claims_to_a_lease_before_they_were_first_seen() -> None:
    witness, lease_s = LeaseWitness(), 30.0
    honest = LeaseRecord(peer_id="QmH", candidate_since=NOW - 500, held_since=NOW - 400, updated_at=NOW)
    first = witness.clamp({"QmH": honest}, NOW, lease_s)
    assert first["QmH"].held_since == NOW - lease_s  # a fresh reader vouches for one lease back at most
    thief = LeaseRecord(peer_id="QmT", candidate_since=0.0, held_since=0.0, updated_at=NOW + 40)
    later = witness.clamp({"QmH": honest, "QmT": thief}, NOW + 40, lease_s)
    assert later["QmH"].held_since == NOW - lease_s and later["QmT"].held_since == NOW + 40 - lease_s
    assert lease_holder(later, MODEL_HASH) == "QmH"
    # A read that misses the holder's record does not make its claim look new.
    witness.clamp({"QmT": thief}, NOW + 41, lease_s)
    assert witness.clamp({"QmH": honest, "QmT": thief}, NOW + 42, lease_s)["QmH"].held_since == NOW - lease_s


def test_a_short_split_heals_by_the_true_claim_times_on_both_sides() -> None:
    # A and B claimed while apart (within a lease of the reunion); each first sees the other's claim now.
    a = LeaseRecord(peer_id="QmA", candidate_since=NOW - 100, held_since=NOW - 20, updated_at=NOW)
    b = LeaseRecord(peer_id="QmB", candidate_since=NOW - 100, held_since=NOW - 10, updated_at=NOW)
    on_a_side, on_b_side = LeaseWitness(), LeaseWitness()
    on_a_side.clamp({"QmA": a}, NOW - 19, 30.0)
    on_b_side.clamp({"QmB": b}, NOW - 9, 30.0)
    views = [w.clamp({"QmA": a, "QmB": b}, NOW, 30.0) for w in (on_a_side, on_b_side)]
    assert [lease_holder(v, MODEL_HASH) for v in views] == ["QmA", "QmA"]


def test_a_claim_cannot_precede_its_candidacy() -> None:
    with pytest.raises(pydantic.ValidationError):
        LeaseRecord.from_dht(lease_value("QmA", 0.0, 0.0) | {"candidate_since": 10.0})


# ------------------------------------------------------------------------------------------------ reports


def report(by: Key, accused: str, created_at: float = NOW) -> ReportRecord:
    return ReportRecord(
        reporter_peer_id=by.peer_id,
        accused_peer_id=accused,
        layers=[0, 4],
        reason="mismatch",
        created_at=created_at,
    )


def test_reports_count_distinct_live_reporters(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    accused = keys[1].peer_id
    assert asyncio.run(directory.publish_report(report(keys[0], accused)))
    assert asyncio.run(directory.publish_report(report(keys[0], accused)))  # again: replaces, still one
    for key in keys[2:]:
        dht.put(reports_key(MODEL_HASH), key.subkey + b"/" + accused.encode(), report(key, accused).to_dht())
    snapshot = read(directory)
    assert snapshot.reports[accused] == {keys[0].peer_id, keys[2].peer_id, keys[3].peer_id}
    dht.clock = NOW + DirectoryConfig().report_ttl_s + 1  # reports expire
    assert accused not in read(directory).reports


def test_reports_naming_another_reporter_are_dropped(keys: list[Key]) -> None:
    dht, directory = swarm(keys)
    forged = report(keys[2], keys[1].peer_id).to_dht()
    dht.put(reports_key(MODEL_HASH), keys[3].subkey + b"/x", forged)  # keys[3] signs keys[2]'s report
    assert read(directory).reports == {}
    with pytest.raises(ValueError, match="is by"):
        asyncio.run(directory.publish_report(report(keys[2], keys[1].peer_id)))


def test_report_record_checks() -> None:
    with pytest.raises(pydantic.ValidationError):
        ReportRecord(reporter_peer_id="a", accused_peer_id="a", layers=[0, 1], reason="", created_at=NOW)
    with pytest.raises(pydantic.ValidationError):
        ReportRecord(reporter_peer_id="a", accused_peer_id="b", layers=[2, 1], reason="", created_at=NOW)
    with pytest.raises(pydantic.ValidationError):
        ReportRecord(
            reporter_peer_id="a", accused_peer_id="b", layers=[0, 1], reason="x" * 600, created_at=NOW
        )


def test_an_older_record_than_the_last_read_is_asked_of_more_nodes(keys: list[Key]) -> None:
    """A node that missed a peer's latest stores answers with its older record: the reader, which saw the
    newer one, asks more nodes and keeps the newest."""
    dht, directory = swarm(keys)
    a = keys[1]
    key = record_key(MODEL_HASH, a.peer_id)
    dht.put(key, a.subkey, peer_record(a.peer_id, 0, 4, updated_at=NOW).to_dht(), expiration=NOW + 30)
    read(directory)
    moved = peer_record(a.peer_id, 0, 6, updated_at=NOW).to_dht()
    dht.put(key, a.subkey, moved, expiration=NOW + 40)
    assert read(directory).peers[a.peer_id].range_end == 6
    stale = (peer_record(a.peer_id, 0, 4, updated_at=NOW).to_dht(), NOW + 30)

    async def one_node_is_behind(keys_: Any, ask: int = 1) -> dict[str, dict[bytes, tuple[Any, float]]]:
        found = {k: await dht.get(k) for k in keys_}
        if ask == 1 and key in found:
            found[key] = {**found[key], a.subkey: stale}
        return found

    dht.read_near = one_node_is_behind  # type: ignore[method-assign]
    assert read(directory).peers[a.peer_id].range_end == 6
