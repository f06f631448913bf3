"""The records FlowSwarm keeps in the DHT, and the schema hivemind checks them against.

Three DHT keys per model, each a dictionary with one subkey per writer:

    "<model_key>_peers"  subkey "[owner:<peer's RSA key>]" -> PeerRecord   (every peer, refreshed every TTL/3)
    "<model_key>_plan"   subkey "[owner:<planner's key>]"  -> PlanRecord   (the elected planner)
    "<model_key>_lease"  subkey "[owner:<candidate's key>]" -> LeaseRecord (planner candidates and the holder)

`model_key` is a prefix of the model hash, so one DHT hosts several models. The "[owner:...]" marker makes
hivemind's RSASignatureValidator demand a signature by that key, so nobody can overwrite another peer's
subkey; the key is the peer's libp2p identity, so readers also check that a record's peer_id is the one
that key hashes to (nobody can announce under another peer's id with a key of their own).

The typed records are pydantic v2 models. hivemind 1.1.12's SchemaValidator needs pydantic.v1 models, so the
v1 schema below wraps the v2 models: its value type validates with the v2 model and returns the value
unchanged (SchemaValidator rejects values that needed conversion).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

import pydantic
import pydantic.v1 as pydantic_v1
from hivemind.dht.schema import BytesWithPublicKey
from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarm.wire import MAX_MADDRS  # one set of wire limits for messages and records

MODEL_KEY_CHARS = 16  # model_key = model_hash[:16]: short keys, still unique among hosted models
MAX_LINKS = 64  # a record carries links to k nearest + a random sample, never the whole swarm

PeerState = Literal["loading", "serving", "leaving"]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0.0)]
ShortStr = Annotated[str, Field(max_length=256)]


class _Record(BaseModel):
    # Built locally: lax (a tuple becomes a list, an int a float). Read from the network: `from_dht`, strict,
    # since a value needing conversion was not written by us. Frozen: records are values.
    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def from_dht(cls, value: Any) -> Self:
        """Parse a value read from the DHT (strict types; raises pydantic.ValidationError)."""
        return cls.model_validate(value, strict=True)


class LinkMeasure(_Record):
    """A measured link from the record's peer to another peer (probe RPCs)."""

    rtt_s: NonNegFloat
    bandwidth_bytes_s: Annotated[float, Field(gt=0.0)]


class PeerRecord(_Record):
    """What a peer announces about itself: identity, held layers, measured speed, free capacity, links."""

    peer_id: ShortStr
    name: ShortStr
    maddrs: Annotated[list[ShortStr], Field(max_length=MAX_MADDRS)]
    protocol_version: int
    model_name: ShortStr
    model_hash: ShortStr
    num_layers: Annotated[int, Field(gt=0)]
    hidden_size: Annotated[int, Field(gt=0)]
    device: ShortStr  # "cpu", "cuda:0", ...
    dtype: ShortStr
    memory_bytes: NonNegInt  # memory budget of this peer
    state: PeerState
    range_start: NonNegInt  # held layers [range_start, range_end)
    range_end: NonNegInt
    decode_layer_tokens_s_b1: NonNegFloat  # decode tokens/s through ONE layer at batch 1
    decode_layer_tokens_s_b8: NonNegFloat  # same at batch 8, total tokens/s of the batch
    prefill_layer_tokens_s: NonNegFloat  # prefill tokens/s through one layer
    max_layers: NonNegInt  # most layers it can hold within its memory budget, leaving room for KV cache
    cache_tokens_total: NonNegInt
    free_cache_tokens: NonNegInt
    active_sessions: NonNegInt
    load: Annotated[float, Field(ge=0.0, le=1.0)]
    links: Annotated[dict[ShortStr, LinkMeasure], Field(max_length=MAX_LINKS)] = Field(default_factory=dict)
    reachable: bool | None = None
    updated_at: NonNegFloat = 0.0  # unix seconds

    @model_validator(mode="after")
    def _check_consistent(self) -> PeerRecord:
        if self.range_end < self.range_start or self.range_end > self.num_layers:
            raise ValueError(
                f"held range [{self.range_start}, {self.range_end}) is not within [0, {self.num_layers})"
            )
        if self.free_cache_tokens > self.cache_tokens_total:
            raise ValueError(f"free_cache_tokens {self.free_cache_tokens} > cache_tokens_total")
        return self

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


class PlanRecord(_Record):
    """A published placement: `plan` is swarm.types.Plan.to_json() (placement keyed by peer id)."""

    epoch: NonNegInt
    planner_peer_id: ShortStr
    plan: dict[str, Any]
    created_at: NonNegFloat

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


class LeaseRecord(_Record):
    """A planner candidacy; `held_since` is set while the writer claims the planner lease.

    `candidate_since` lets the others see how long a candidacy has been visible (settle delay), and
    `held_since` orders two claimants after a split (the earlier holder keeps the lease).
    """

    peer_id: ShortStr
    candidate_since: NonNegFloat
    held_since: NonNegFloat | None = None
    updated_at: NonNegFloat
    leaving: bool = False  # a resigning candidate: ignore it without waiting for it to expire

    def to_dht(self) -> dict[str, Any]:
        return self.model_dump(mode="python")


def model_key(model_hash: str) -> str:
    """The DHT key prefix of a model: hosted models must have distinct hashes."""
    if not model_hash or not all(c.isalnum() or c in "-_" for c in model_hash):
        raise ValueError(f"bad model hash {model_hash!r}: expected a non-empty alphanumeric string")
    return model_hash[:MODEL_KEY_CHARS]


def peers_key(model_hash: str) -> str:
    return f"{model_key(model_hash)}_peers"


def plan_key(model_hash: str) -> str:
    return f"{model_key(model_hash)}_plan"


def lease_key(model_hash: str) -> str:
    return f"{model_key(model_hash)}_lease"


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


class FlowSwarmSchema(pydantic_v1.BaseModel):
    """The v1 schema for SchemaValidator(FlowSwarmSchema, prefix=model_key(model_hash))."""

    peers: dict[BytesWithPublicKey, CheckedPeerRecord]  # type: ignore[valid-type]
    plan: dict[BytesWithPublicKey, CheckedPlanRecord]  # type: ignore[valid-type]
    lease: dict[BytesWithPublicKey, CheckedLeaseRecord]  # type: ignore[valid-type]

    class Config:
        extra = pydantic_v1.Extra.forbid
