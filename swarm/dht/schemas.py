"""The records FlowSwarm keeps in the DHT, and the schema hivemind checks them against.

The DHT keys of a model, each a dictionary with one subkey per writer:

    "<model_key>_peers<s>"   subkey "[owner:<peer's RSA key>]" -> PeerRecord (every peer, refreshed every TTL/3)
    "<model_key>_plan"       subkey "[owner:<planner's key>]"  -> PlanRecord   (the elected planner)
    "<model_key>_lease"      subkey "[owner:<candidate's key>]" -> LeaseRecord (planner candidates and the holder)
    "<model_key>_reports"    subkey "[owner:<reporter's key>]/<accused id>" -> ReportRecord (misbehaviour reports)
    "<model_key>_summary<c>" subkey "[owner:<planner's key>]"  -> SummaryRecord (the swarm's version, read often)

The peer records are spread over PEER_SHARDS keys (shard ``s`` by a hash of the peer id; "" for shard 0), and
the planner writes the same summary under `summary_copies` keys (copy ``c``; "" for copy 0), each reader
reading the copy its own id picks: different DHT nodes store each key, so no node answers everyone.

`model_key` is a prefix of the model hash, so one DHT hosts several models. The "[owner:...]" marker makes
hivemind's RSASignatureValidator demand a signature by that key, so nobody can overwrite another peer's
subkey; the key is the peer's libp2p identity, so readers also check that a record's peer_id is the one
that key hashes to (nobody can announce under another peer's id with a key of their own).

The typed records are pydantic v2 models. hivemind 1.1.12's SchemaValidator needs pydantic.v1 models, so the
v1 schema below wraps the v2 models: its value type validates with the v2 model and returns the value
unchanged (SchemaValidator rejects values that needed conversion).

Anyone can write these keys, so every number is bounded (finite, within a plausible cap), every list and
string too: a record outside the bounds is invalid as a whole, on the storing node and on every reader.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, Self

import pydantic
import pydantic.v1 as pydantic_v1
from hivemind.dht.schema import BytesWithPublicKey
from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarm.types import (
    MAX_SUMMARY_COPIES,
    PEER_SHARDS,
    EdgeFlow,
    LayerRange,
    NodeID,
    Plan,
)
from swarm.wire import MAX_HIDDEN_SIZE, MAX_LAYER, MAX_MADDRS  # one set of limits for messages and records

MODEL_KEY_CHARS = 16  # model_key = model_hash[:16]: short keys, still unique among hosted models
MAX_LINKS = 64  # a record carries links to k nearest + a random sample, never the whole swarm
DIGEST_CHARS = 16  # hex characters of a SummaryRecord's digest (64 bits)
# Hard bounds: a value past these is not a measurement but garbage or an attack (the planner and routing
# clamp further, to configurable plausible caps).
MAX_TOKENS_S = 1e9  # tokens/s through one layer: ~1000x the fastest measured layer of any model we serve
MAX_BANDWIDTH_BYTES_S = 1e12  # 8 Tbit/s, past any network interface
MAX_RTT_S = 60.0
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB
MAX_CACHE_TOKENS = 1 << 32
MAX_SESSIONS = 1 << 20
MAX_TIME_S = 1e11  # unix seconds: year ~5000; also bounds created_at / updated_at / held_since
MAX_EPOCH = (1 << 53) - 1  # exact in a float, so no reader (JSON, JS) rounds two epochs together
MAX_PLAN_PEERS = 1024  # peers one plan may place
MAX_PLAN_FLOWS = 16_384  # edges of one plan's flow (at most one per pair of consecutive peers)
MAX_REASON_CHARS = 512
MAX_OLDER_RANGES = 4  # ranges a moving peer still serves for their open sessions (usually 0 or 1)

PeerState = Literal["loading", "serving", "leaving"]
QuantKind = Literal["none", "int8", "nf4"]  # swarm.types.QUANT_KINDS
NonNegInt = Annotated[int, Field(ge=0)]
Count = Annotated[int, Field(ge=0, le=MAX_SESSIONS)]
CacheTokens = Annotated[int, Field(ge=0, le=MAX_CACHE_TOKENS)]
LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYER)]
NonNegFloat = Annotated[float, Field(ge=0.0)]
TokensS = Annotated[float, Field(ge=0.0, le=MAX_TOKENS_S)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_TIME_S)]  # a duration or a unix time
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]
ShortStr = Annotated[str, Field(max_length=256)]


class _Record(BaseModel):
    # Built locally: lax (a tuple becomes a list, an int a float). Read from the network: `from_dht`, strict,
    # since a value needing conversion was not written by us. Frozen: records are values. No inf or nan
    # anywhere: one infinite speed would make every max flow infinite.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @classmethod
    def from_dht(cls, value: Any) -> Self:
        """Parse a value read from the DHT (strict types; raises pydantic.ValidationError)."""
        return cls.model_validate(value, strict=True)


class LinkMeasure(_Record):
    """A measured link between the record's peer and another peer (probe RPCs): the round trip, the bandwidth
    from the record's peer to the other, and (None when not measured: records from before the field) back."""

    rtt_s: Annotated[float, Field(ge=0.0, le=MAX_RTT_S)]
    bandwidth_bytes_s: Annotated[float, Field(gt=0.0, le=MAX_BANDWIDTH_BYTES_S)]
    reverse_bandwidth_bytes_s: Annotated[float, Field(gt=0.0, le=MAX_BANDWIDTH_BYTES_S)] | None = None


class OlderRange(_Record):
    """A range the peer no longer takes new sessions on but still serves for the sessions open on it."""

    start: LayerIndex  # layers [start, end)
    end: LayerIndex
    sessions: Annotated[int, Field(gt=0, le=MAX_SESSIONS)]  # open on it; a range with none is dropped

    @model_validator(mode="after")
    def _check_range(self) -> OlderRange:
        if not self.start < self.end:
            raise ValueError(f"empty older range [{self.start}, {self.end})")
        return self


class PeerRecord(_Record):
    """What a peer announces about itself: identity, held layers, measured speed, free capacity, links."""

    peer_id: ShortStr
    name: ShortStr
    maddrs: Annotated[list[ShortStr], Field(max_length=MAX_MADDRS)]
    protocol_version: Annotated[int, Field(ge=0, lt=1 << 31)]
    model_name: ShortStr
    model_hash: ShortStr
    num_layers: Annotated[int, Field(gt=0, le=MAX_LAYER)]
    hidden_size: Annotated[int, Field(gt=0, le=MAX_HIDDEN_SIZE)]
    device: ShortStr  # "cpu", "cuda:0", ...
    dtype: ShortStr
    quant: QuantKind = "none"  # how its layers' projections are held (absent from records before the field)
    memory_bytes: Annotated[int, Field(ge=0, le=MAX_MEMORY_BYTES)]  # memory budget of this peer
    state: PeerState
    range_start: LayerIndex  # held layers [range_start, range_end)
    range_end: LayerIndex
    decode_layer_tokens_s_b1: TokensS  # decode tokens/s through ONE layer at batch 1
    decode_layer_tokens_s_b8: TokensS  # same at batch 8, total tokens/s of the batch
    prefill_layer_tokens_s: TokensS  # prefill tokens/s through one layer
    max_layers: LayerIndex  # most layers it can hold within its memory budget, leaving room for KV cache
    cache_tokens_total: CacheTokens
    free_cache_tokens: CacheTokens
    active_sessions: Count
    load: Annotated[float, Field(ge=0.0, le=1.0)]
    links: Annotated[dict[ShortStr, LinkMeasure], Field(max_length=MAX_LINKS)] = Field(default_factory=dict)
    # Make before break: while the peer moves, the ranges it still serves for their open sessions. Routing
    # sends new sessions only to [range_start, range_end); this is for the status page and the planner's view.
    older_ranges: Annotated[list[OlderRange], Field(max_length=MAX_OLDER_RANGES)] = Field(
        default_factory=list
    )
    reachable: bool | None = None
    updated_at: Seconds = 0.0  # unix seconds

    @model_validator(mode="after")
    def _check_consistent(self) -> PeerRecord:
        if self.range_end < self.range_start or self.range_end > self.num_layers:
            raise ValueError(
                f"held range [{self.range_start}, {self.range_end}) is not within [0, {self.num_layers})"
            )
        if self.max_layers > self.num_layers:
            raise ValueError(f"max_layers {self.max_layers} > num_layers {self.num_layers}")
        if self.free_cache_tokens > self.cache_tokens_total:
            raise ValueError(f"free_cache_tokens {self.free_cache_tokens} > cache_tokens_total")
        for older in self.older_ranges:
            if older.end > self.num_layers:
                raise ValueError(f"older range [{older.start}, {older.end}) is past layer {self.num_layers}")
        if sum(older.sessions for older in self.older_ranges) > self.active_sessions:
            raise ValueError("older ranges hold more sessions than the peer has open")
        return self

    def to_dht(self) -> dict[str, Any]:
        value = self.model_dump(mode="python")
        if not value["older_ranges"]:  # absent when empty: readers from before the field accept the record
            del value["older_ranges"]
        if value["quant"] == "none":  # likewise
            del value["quant"]
        for link in value["links"].values():
            if link["reverse_bandwidth_bytes_s"] is None:  # likewise
                del link["reverse_bandwidth_bytes_s"]
        return value


class FlowBody(_Record):
    """One edge flow of a plan (swarm.types.EdgeFlow as JSON)."""

    src: ShortStr
    dst: ShortStr
    tokens_s: Annotated[float, Field(ge=0.0)]


class PlanBody(_Record):
    """swarm.types.Plan.to_json(), validated: placement maps peer id -> [start, end) with 0 <= start < end."""

    method: ShortStr
    epoch: Epoch
    placement: Annotated[
        dict[ShortStr, Annotated[list[LayerIndex], Field(min_length=2, max_length=2)]],
        Field(max_length=MAX_PLAN_PEERS),
    ]
    max_flow_tokens_s: Annotated[float, Field(ge=0.0)]
    upper_bound_tokens_s: Annotated[float, Field(ge=0.0)] = 0.0
    flows: Annotated[list[FlowBody], Field(max_length=MAX_PLAN_FLOWS)] = Field(default_factory=list)
    solve_s: Annotated[float, Field(ge=0.0, le=MAX_TIME_S)] = 0.0
    decode_flows: Annotated[list[FlowBody], Field(max_length=MAX_PLAN_FLOWS)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_ranges(self) -> PlanBody:
        for peer_id, (start, end) in self.placement.items():
            if not start < end:
                raise ValueError(f"peer {peer_id}: empty layer range [{start}, {end})")
        return self

    def to_plan(self) -> Plan:
        return Plan(
            method=self.method,
            epoch=self.epoch,
            placement={NodeID(n): LayerRange(r[0], r[1]) for n, r in self.placement.items()},
            max_flow_tokens_s=self.max_flow_tokens_s,
            upper_bound_tokens_s=self.upper_bound_tokens_s,
            flows=tuple(EdgeFlow(NodeID(f.src), NodeID(f.dst), f.tokens_s) for f in self.flows),
            solve_s=self.solve_s,
            decode_flows=tuple(EdgeFlow(NodeID(f.src), NodeID(f.dst), f.tokens_s) for f in self.decode_flows),
        )


class PlanRecord(_Record):
    """A published placement: `plan` is swarm.types.Plan.to_json() (placement keyed by peer id), checked
    against PlanBody on every parse, so a record that parsed always yields a Plan (`to_plan`)."""

    epoch: Epoch
    planner_peer_id: ShortStr
    plan: dict[str, Any]
    created_at: Seconds

    @model_validator(mode="after")
    def _check_plan(self) -> PlanRecord:
        try:
            body = PlanBody.model_validate(self.plan, strict=True)
        except pydantic.ValidationError as e:
            raise ValueError(f"malformed plan body ({e.error_count()} errors)") from e
        if body.epoch != self.epoch:
            raise ValueError(f"plan body says epoch {body.epoch}, the record {self.epoch}")
        return self

    def to_plan(self) -> Plan:
        """The plan as swarm.types.Plan (the record validated its body already)."""
        return PlanBody.model_validate(self.plan, strict=True).to_plan()

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


class LeaseRecord(_Record):
    """A planner candidacy; `held_since` is set while the writer claims the planner lease.

    `candidate_since` lets the others see how long a candidacy has been visible (settle delay), and
    `held_since` orders two claimants after a split (the earlier holder keeps the lease).
    """

    peer_id: ShortStr
    candidate_since: Seconds
    held_since: Seconds | None = None
    updated_at: Seconds
    leaving: bool = False  # a resigning candidate: ignore it without waiting for it to expire

    @model_validator(mode="after")
    def _check_order(self) -> LeaseRecord:
        if self.held_since is not None and self.held_since < self.candidate_since:
            raise ValueError("held_since must not precede candidate_since: a claim follows its candidacy")
        return self

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


class ReportRecord(_Record):
    """A signed claim by `reporter_peer_id` that `accused_peer_id` returned wrong outputs for `layers`
    ([start, end)). Stored under the reporter's own subkey, one per accused peer."""

    reporter_peer_id: ShortStr
    accused_peer_id: ShortStr
    layers: Annotated[list[LayerIndex], Field(min_length=2, max_length=2)]
    reason: Annotated[str, Field(max_length=MAX_REASON_CHARS)]
    created_at: Seconds

    @model_validator(mode="after")
    def _check(self) -> ReportRecord:
        if not self.layers[0] < self.layers[1]:
            raise ValueError(f"empty layer range {self.layers}")
        if self.reporter_peer_id == self.accused_peer_id:
            raise ValueError("a peer cannot report itself")
        return self

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


class SummaryRecord(_Record):
    """The swarm's version, small enough to read every few seconds: the planner (lease holder) writes the
    digest of the membership it read (swarm.dht.directory.membership_digest: who is there, in which state,
    holding which layers) and its plan's epoch. Readers fetch the full records only when either changes."""

    planner_peer_id: ShortStr
    plan_epoch: Epoch
    peers_digest: Annotated[
        str, Field(min_length=DIGEST_CHARS, max_length=DIGEST_CHARS, pattern="^[0-9a-f]+$")
    ]
    peer_count: Annotated[int, Field(ge=0, le=MAX_SESSIONS)]
    created_at: Seconds
    copies: Annotated[int, Field(ge=1, le=MAX_SUMMARY_COPIES)] = 1  # keys it is written under (summary_key)

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


def model_key(model_hash: str) -> str:
    """The DHT key prefix of a model: hosted models must have distinct hashes."""
    if not model_hash or not all(c.isalnum() or c in "-_" for c in model_hash):
        raise ValueError(f"bad model hash {model_hash!r}: expected a non-empty alphanumeric string")
    return model_hash[:MODEL_KEY_CHARS]


def _numbered(n: int) -> str:
    return str(n) if n else ""


def shard_of(peer_id: str) -> int:
    """The peer-records shard a peer's record belongs in (readers drop it anywhere else)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % PEER_SHARDS


def peers_key(model_hash: str, shard: int = 0) -> str:
    if not 0 <= shard < PEER_SHARDS:
        raise ValueError(f"peer shard {shard} out of range 0..{PEER_SHARDS - 1}")
    return f"{model_key(model_hash)}_peers{_numbered(shard)}"


def record_key(model_hash: str, peer_id: str) -> str:
    """The key ``peer_id``'s record is stored under."""
    return peers_key(model_hash, shard_of(peer_id))


def plan_key(model_hash: str) -> str:
    return f"{model_key(model_hash)}_plan"


def lease_key(model_hash: str) -> str:
    return f"{model_key(model_hash)}_lease"


def reports_key(model_hash: str) -> str:
    return f"{model_key(model_hash)}_reports"


def summary_key(model_hash: str, copy: int = 0) -> str:
    if not 0 <= copy < MAX_SUMMARY_COPIES:
        raise ValueError(f"summary copy {copy} out of range 0..{MAX_SUMMARY_COPIES - 1}")
    return f"{model_key(model_hash)}_summary{_numbered(copy)}"


def summary_copy_of(peer_id: str, copies: int) -> int:
    """The summary copy ``peer_id`` reads, of ``copies``."""
    if copies <= 1:
        return 0
    return int.from_bytes(hashlib.sha256(b"summary/" + peer_id.encode()).digest()[:4], "big") % copies


def _v1_value_type(model: type[_Record]) -> type:
    """A pydantic.v1 type whose validation is `model.from_dht(value)`, returning value unchanged."""

    class _Checked:
        @classmethod
        def __get_validators__(cls):  # type: ignore[no-untyped-def]
            yield cls.check

        @classmethod
        def check(cls, value: Any) -> Any:
            try:
                model.from_dht(value)
            except pydantic.ValidationError as e:
                raise ValueError(f"invalid {model.__name__}: {e.error_count()} errors") from e
            return value

    _Checked.__name__ = f"Checked{model.__name__}"
    return _Checked


CheckedPeerRecord = _v1_value_type(PeerRecord)
CheckedPlanRecord = _v1_value_type(PlanRecord)
CheckedLeaseRecord = _v1_value_type(LeaseRecord)
CheckedReportRecord = _v1_value_type(ReportRecord)
CheckedSummaryRecord = _v1_value_type(SummaryRecord)


class _SchemaConfig:
    extra = pydantic_v1.Extra.forbid


# The v1 schema for SchemaValidator(FlowSwarmSchema, prefix=model_key(model_hash)): one field per key suffix
# (peers, peers1.., plan, lease, reports, summary, summary1..).
FlowSwarmSchema: type[pydantic_v1.BaseModel] = pydantic_v1.create_model(  # type: ignore[call-overload]
    "FlowSwarmSchema",
    __config__=_SchemaConfig,
    plan=(dict[BytesWithPublicKey, CheckedPlanRecord], None),  # type: ignore[valid-type]
    lease=(dict[BytesWithPublicKey, CheckedLeaseRecord], None),  # type: ignore[valid-type]
    reports=(dict[BytesWithPublicKey, CheckedReportRecord], None),  # type: ignore[valid-type]
    **{
        f"peers{_numbered(s)}": (dict[BytesWithPublicKey, CheckedPeerRecord], None)  # type: ignore[valid-type]
        for s in range(PEER_SHARDS)
    },
    **{
        f"summary{_numbered(c)}": (dict[BytesWithPublicKey, CheckedSummaryRecord], None)  # type: ignore[valid-type]
        for c in range(MAX_SUMMARY_COPIES)
    },
)
