"""Records, the hivemind validators that guard them, and the signer check on read (no network)."""

from __future__ import annotations

import pydantic
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P

from swarm.dht.directory import SwarmSnapshot, coverage, parse_records, pick_plan
from swarm.dht.identity import load_private_key, owner_peer_id, peer_id_of_public_key
from swarm.dht.schemas import (
    MAX_SUMMARY_COPIES,
    PEER_SHARDS,
    FlowSwarmSchema,
    LinkMeasure,
    PeerRecord,
    PlanRecord,
    SummaryRecord,
    model_key,
    peers_key,
    shard_of,
    summary_copy_of,
    summary_key,
)
from swarm.types import Plan, summary_copies
from tests.unit.dht.records import MODEL_HASH, peer_record

pytestmark = pytest.mark.timeout(60)


class Signer:
    """One identity as a DHT node would hold it: key, marker, validators."""

    def __init__(self, tmp_path, name: str) -> None:
        path = tmp_path / f"{name}.key"
        P2P.generate_identity(str(path))
        self.key = load_private_key(path)
        self.rsa = RSASignatureValidator(self.key)
        self.validator = CompositeValidator(
            [self.rsa, SchemaValidator(FlowSwarmSchema, allow_extra_keys=True, prefix=model_key(MODEL_HASH))]
        )
        self.peer_id = peer_id_of_public_key(self.key.get_public_key())
        self.subkey = self.rsa.local_public_key

    def record(self, key: str, subkey: bytes, value: object, sign: bool = True) -> DHTRecord:
        ser = DHTProtocol.serializer
        record = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(),
            subkey=ser.dumps(subkey),
            value=ser.dumps(value),
            expiration_time=1e10,
        )
        if sign:
            record = DHTRecord(
                record.key, record.subkey, self.validator.sign_value(record), record.expiration_time
            )
        return record


@pytest.fixture(scope="module")
def signers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    return Signer(tmp, "a"), Signer(tmp, "b")


def test_identity_file_key_gives_the_libp2p_peer_id(tmp_path):
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID

    path = tmp_path / "id.key"
    P2P.generate_identity(str(path))
    expected = PeerID.from_identity(path.read_bytes()).to_base58()
    assert peer_id_of_public_key(load_private_key(path).get_public_key()) == expected


def test_own_signed_valid_record_is_accepted(signers):
    a, _ = signers
    record = a.record(peers_key(MODEL_HASH), a.subkey, peer_record(a.peer_id).to_dht())
    assert a.validator.validate(record)


def test_record_under_another_peers_subkey_is_rejected(signers):
    a, b = signers
    # b writes into a's subkey: b's validator does not sign it (not its key), and a's signature is missing.
    forged = b.record(peers_key(MODEL_HASH), a.subkey, peer_record(a.peer_id).to_dht())
    assert not a.validator.validate(forged)
    assert not b.validator.validate(forged)


def test_unsigned_record_is_rejected(signers):
    a, _ = signers
    unsigned = a.record(peers_key(MODEL_HASH), a.subkey, peer_record(a.peer_id).to_dht(), sign=False)
    assert not a.validator.validate(unsigned)


def test_schema_invalid_record_is_rejected(signers):
    a, _ = signers
    bad = peer_record(a.peer_id).to_dht() | {"range_end": 99}  # past the last layer
    assert not a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, bad))
    wrong_type = peer_record(a.peer_id).to_dht() | {"num_layers": 8.0}
    assert not a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, wrong_type))
    extra = peer_record(a.peer_id).to_dht() | {"surprise": 1}
    assert not a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, extra))


def test_subkey_without_owner_marker_is_rejected(signers):
    a, _ = signers
    record = a.record(peers_key(MODEL_HASH), b"no-owner", peer_record(a.peer_id).to_dht())
    assert not a.validator.validate(record)


def test_other_models_keys_pass_through(signers):
    a, _ = signers
    assert a.validator.validate(a.record("someothermodel_peers", b"x", {"anything": 1}, sign=False))


def test_read_drops_records_naming_another_peer(signers):
    a, b = signers
    raw = {
        a.subkey: (peer_record(a.peer_id).to_dht(), 1e10),
        b.subkey: (peer_record(a.peer_id, 4, 8).to_dht(), 1e10),  # b signs, but claims to be a
        b"junk": (peer_record(b.peer_id).to_dht(), 1e10),
    }
    peers = parse_records(raw, PeerRecord, "peer")
    assert list(peers) == [a.peer_id]
    assert peers[a.peer_id].range_end == 4
    assert owner_peer_id(b.subkey) == b.peer_id


def test_peer_record_checks():
    record = peer_record("QmA")
    assert PeerRecord.from_dht(record.to_dht()) == record
    assert peer_record("QmA", maddrs=("a",), load=0).maddrs == ["a"]  # built locally: lax
    with pytest.raises(pydantic.ValidationError):
        PeerRecord.from_dht(record.to_dht() | {"num_layers": 8.0})  # read from the network: strict
    with pytest.raises(pydantic.ValidationError):
        peer_record("QmA", 5, 3)
    with pytest.raises(pydantic.ValidationError):
        peer_record("QmA", free_cache_tokens=10**6)
    with pytest.raises(pydantic.ValidationError):
        peer_record("QmA", state="sleeping")
    with pytest.raises(pydantic.ValidationError):
        peer_record("QmA", load=1.5)
    with pytest.raises(ValueError, match="bad model hash"):
        model_key("a/b")


def test_coverage_counts_serving_peers_only():
    peers = {
        "a": peer_record("a", 0, 4),
        "b": peer_record("b", 2, 8),
        "c": peer_record("c", 0, 8, state="loading"),
        "d": peer_record("d", 0, 8, state="leaving"),
    }
    snapshot = SwarmSnapshot(peers=peers, plan=None, planner_peer_id=None, fetched_at=0.0)
    assert coverage(snapshot, 8) == [1, 1, 2, 2, 1, 1, 1, 1]
    assert set(snapshot.serving()) == {"a", "b"}


def test_pick_plan_takes_only_the_lease_holders_plan():
    def plan(pid: str, epoch: int, created_at: float) -> PlanRecord:
        body = Plan("milp", {}, 0.0, epoch=epoch).to_json()
        return PlanRecord(epoch=epoch, planner_peer_id=pid, plan=body, created_at=created_at)

    plans = {"a": plan("a", 10**15, 10.0), "b": plan("b", 3, 5.0), "c": plan("c", 2, 50.0)}
    assert pick_plan(plans, "b") == plans["b"]  # a's newer epoch does not matter: a holds no lease
    assert pick_plan(plans, None) is None
    assert pick_plan(plans, "d") is None
    assert pick_plan({}, None) is None


def test_gateway_options_are_off_unless_opted_in_and_relays_are_on():
    from swarm.dht import ReachabilityConfig

    kwargs = ReachabilityConfig().p2p_kwargs()
    assert kwargs == {
        "use_relay": True,  # bounded (test_reachability.py); sends nothing to the gateway
        "use_auto_relay": False,
        "nat_port_map": False,
        "auto_nat": False,
        "use_ipfs": False,
    }
    home = ReachabilityConfig(nat_port_map=True, announce_maddrs=("/ip4/1.2.3.4/tcp/31337",))
    assert home.p2p_kwargs()["announce_maddrs"] == ["/ip4/1.2.3.4/tcp/31337"]
    assert home.p2p_kwargs()["nat_port_map"] is True
    with pytest.raises(ValueError, match="needs use_relay"):
        ReachabilityConfig(use_relay=False).p2p_kwargs(("/ip4/1.2.3.4/tcp/1/p2p/QmRelay",))


def _older(*ranges: tuple[int, int, int]) -> list[dict[str, int]]:
    return [{"start": a, "end": b, "sessions": n} for a, b, n in ranges]


def test_older_ranges_round_trip_and_are_absent_when_empty(signers):
    a, _ = signers
    moving = peer_record(a.peer_id, 4, 8, active_sessions=3, older_ranges=_older((0, 4, 2), (2, 6, 1)))
    assert PeerRecord.from_dht(moving.to_dht()) == moving
    assert a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, moving.to_dht()))
    settled = peer_record(a.peer_id).to_dht()
    # A reader from before the field (extra="forbid") still accepts a record of a peer that is not moving.
    assert "older_ranges" not in settled and PeerRecord.from_dht(settled).older_ranges == []


@pytest.mark.parametrize(
    ("older", "why"),
    [
        (_older((4, 4, 1)), "empty range"),
        (_older((6, 4, 1)), "reversed range"),
        (_older((4, 9, 1)), "past the last layer"),
        (_older((0, 4, 0)), "a range with no sessions is dropped, never announced"),
        (_older((0, 4, 5)), "more sessions than the peer has open"),
        (_older(*[(0, 4, 1)] * 5), "more ranges than MAX_OLDER_RANGES"),
        ([{"start": 0, "end": 4}], "missing field"),
        ([{"start": 0, "end": 4, "sessions": 1, "x": 1}], "extra field"),
        ([{"start": 0.0, "end": 4, "sessions": 1}], "a float where an int belongs"),
        ([[0, 4, 1]], "a list where a record belongs"),
        ({"start": 0}, "not a list"),
    ],
)
def test_hostile_older_ranges_are_rejected(signers, older, why):
    a, _ = signers
    value = peer_record(a.peer_id, active_sessions=4).to_dht() | {"older_ranges": older}
    with pytest.raises(pydantic.ValidationError):
        PeerRecord.from_dht(value)
    assert not a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, value)), why


def test_links_measured_both_ways_round_trip_and_old_links_stay_valid(signers):
    a, _ = signers
    both = {"QmB": LinkMeasure(rtt_s=0.1, bandwidth_bytes_s=2.5e6, reverse_bandwidth_bytes_s=1.25e7)}
    record = peer_record(a.peer_id, links=both)
    assert PeerRecord.from_dht(record.to_dht()) == record
    assert a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, record.to_dht()))
    # A link measured one way (a peer from before the field) is announced, and read, as before.
    old = peer_record(a.peer_id).to_dht()
    assert old["links"]["QmOther"] == {"rtt_s": 0.001, "bandwidth_bytes_s": 1e9}
    assert PeerRecord.from_dht(old).links["QmOther"].reverse_bandwidth_bytes_s is None
    assert a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, old))


@pytest.mark.parametrize("reverse", [0.0, -1.0, float("inf"), float("nan"), 2e12, "1e6", [1e6]])
def test_hostile_reverse_bandwidths_are_rejected(signers, reverse):
    a, _ = signers
    value = peer_record(a.peer_id).to_dht()
    value["links"] = {"QmB": {"rtt_s": 0.01, "bandwidth_bytes_s": 1e6, "reverse_bandwidth_bytes_s": reverse}}
    with pytest.raises(pydantic.ValidationError):
        PeerRecord.from_dht(value)
    assert not a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, value))


def test_quant_round_trips_and_is_absent_when_none(signers):
    a, _ = signers
    quantized = peer_record(a.peer_id, device="cuda:0", dtype="float16", quant="nf4")
    assert quantized.to_dht()["quant"] == "nf4"
    assert PeerRecord.from_dht(quantized.to_dht()) == quantized
    assert a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, quantized.to_dht()))
    # A reader from before the field (extra="forbid") still accepts an unquantized peer's record, and a record
    # from before the field reads as unquantized.
    plain = peer_record(a.peer_id).to_dht()
    assert "quant" not in plain and PeerRecord.from_dht(plain).quant == "none"


def test_quant_kinds_are_the_records_kinds():
    from typing import get_args

    from swarm.dht.schemas import QuantKind
    from swarm.types import QUANT_KINDS

    assert get_args(QuantKind) == QUANT_KINDS


@pytest.mark.parametrize("quant", ["fp3", "NF4", "", "x" * 300, 4, None, ["nf4"], {"kind": "nf4"}])
def test_hostile_quant_kinds_are_rejected(signers, quant):
    a, _ = signers
    value = peer_record(a.peer_id).to_dht() | {"quant": quant}
    with pytest.raises(pydantic.ValidationError):
        PeerRecord.from_dht(value)
    assert not a.validator.validate(a.record(peers_key(MODEL_HASH), a.subkey, value))


def test_every_shard_and_summary_copy_key_is_checked_by_the_schema(signers):
    a, _ = signers
    record = peer_record(a.peer_id).to_dht()
    for shard in (0, 1, PEER_SHARDS - 1):
        assert a.validator.validate(a.record(peers_key(MODEL_HASH, shard), a.subkey, record))
        # a summary is not a peer record: the shard keys are typed like the first
        assert not a.validator.validate(a.record(peers_key(MODEL_HASH, shard), a.subkey, {"x": 1}))
    summary = SummaryRecord(
        planner_peer_id=a.peer_id,
        plan_epoch=1,
        peers_digest="0" * 16,
        peer_count=250,
        created_at=1.0,
        copies=3,
    ).to_dht()
    for copy in (0, 2, MAX_SUMMARY_COPIES - 1):
        assert a.validator.validate(a.record(summary_key(MODEL_HASH, copy), a.subkey, summary))
        assert not a.validator.validate(a.record(summary_key(MODEL_HASH, copy), a.subkey, record))
    with pytest.raises(ValueError):
        peers_key(MODEL_HASH, PEER_SHARDS)


def test_summary_copies_grow_with_the_swarm_and_readers_spread_over_them():
    assert [summary_copies(n) for n in (0, 1, 100, 101, 1000, 10**6)] == [1, 1, 1, 2, 10, MAX_SUMMARY_COPIES]
    assert summary_copy_of("QmA", 1) == 0
    picks = {summary_copy_of(f"Qm{i}", 10) for i in range(200)}
    assert picks == set(range(10))
    assert {shard_of(f"Qm{i}") for i in range(500)} == set(range(PEER_SHARDS))
