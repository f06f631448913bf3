"""Property-based fuzzing of the wire decoders: whatever bytes arrive, only ProtocolError (or its subclass
VersionMismatch) comes out of decode_request / decode_reply; never another exception.

Inputs: garbage bytes; valid messages truncated or with bytes flipped; headers declaring huge strings, bins,
arrays and maps; deep or wide msgpack; every field of every kind replaced by arbitrary msgpack values (wrong
types, negative and huge numbers, nested containers); tensors with wrong dtypes, shapes and byte counts.
``max_examples`` keeps the file fast on a loaded 2-core machine; no example database is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm import PROTOCOL_VERSION
from swarm.errors import ProtocolError
from swarm.wire import (
    CloseReply,
    CloseRequest,
    ErrorReply,
    Hop,
    HopTiming,
    InfoReply,
    InfoRequest,
    ProbeReply,
    ProbeRequest,
    StepAck,
    StepReply,
    StepRequest,
    StepWait,
    StepWaits,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
Decode = Callable[[bytes], object]
DECODERS = [decode_request, decode_reply]

# Numbers msgpack can carry, biased to the edges: negative, zero, limits, 64-bit extremes.
NUMBERS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 0, 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**64 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=40), st.binary(max_size=64))
# Arbitrary msgpack values: nested lists and maps, deep or wide.
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=8), st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=40,
)

ROUTE = (Hop("QmPeerA", ("/ip4/127.0.0.1/tcp/1/p2p/QmPeerA",), 2, 4), Hop("QmPeerB", (), 4, 6))
VALID_REQUESTS = [
    StepRequest("abc", 3, torch.randn(2, 8), 0, 2, 64, "hash", ROUTE),
    StepRequest("abc", 3, torch.randn(1, 8), 0, 2, 64, "hash", ROUTE, timeout_s=5.0, wait_result=True),
    StepRequest("abc", 3, torch.randn(2, 70), 0, 2, 64, "hash", ROUTE, codec="q8", lossless=True),
    StepWait("abc", 3, 5.0),
    StepWait("abc", 3, 5.0, codec="q8"),
    StepWaits((StepWait("abc", 3, 5.0), StepWait("def", 0, 1.0))),
    CloseRequest("abc", ROUTE),
    InfoRequest(),
    ProbeRequest(b"x" * 32, 16, "QmBack", ("/ip4/127.0.0.1/tcp/5",)),
]
VALID_REPLIES = [
    StepReply(torch.randn(1, 8).to(torch.bfloat16), (HopTiming("QmA", 0, 2, 0.0, 0.1, 0.2),)),
    StepReply(torch.randn(1, 8), (), codec="f16"),
    StepReply(torch.randn(3, 130), (), codec="q8"),
    CloseReply(True),
    StepAck((HopTiming("QmA", 0, 2, 0.0, 0.1, 0.2), HopTiming("QmB", 2, 4, 0.0, 0.0, 0.0))),
    InfoReply("QmA", "alice", "tiny", "h", 4, 16, "float32", 0, 2, 100, 90, 1, "serving"),
    ProbeReply("QmA", 10, b"yy", False, "no"),
    ErrorReply("no_route", "missing", "QmB", (3, 4)),
]
VALID_FRAMES = [encode_request(m) for m in VALID_REQUESTS] + [encode_reply(m) for m in VALID_REPLIES]


def _only_protocol_errors(decode: Decode, data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass  # VersionMismatch included; anything else fails the test


def _pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


@FUZZ
@given(data=st.binary(max_size=512), decode=st.sampled_from(DECODERS))
def test_garbage_bytes(data: bytes, decode: Decode) -> None:
    _only_protocol_errors(decode, data)


@FUZZ
@given(
    frame=st.sampled_from(VALID_FRAMES),
    cut=st.integers(0, 10**6),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    decode=st.sampled_from(DECODERS),
)
def test_truncated_and_corrupted_frames(
    frame: bytes, cut: int, flips: list[tuple[int, int]], decode: Decode
) -> None:
    data = bytearray(frame)
    for where, value in flips:
        data[where % len(data)] = value
    _only_protocol_errors(decode, bytes(data[: cut % (len(data) + 1)]))


# Headers that declare far more than they carry (str32, bin32, array32, map32, ext32), nested or not.
HUGE_HEADERS = st.sampled_from(
    [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"]
    + [b"\xc9\x7f\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xde\xff\xff", b"\xcf" + b"\xff" * 8]
)


@FUZZ
@given(
    kind=st.sampled_from(
        ["step", "wait", "close", "info", "probe", "step_reply", "step_ack", "error", "info_reply"]
    ),
    headers=st.lists(HUGE_HEADERS, min_size=1, max_size=30),
    tail=st.binary(max_size=64),
    decode=st.sampled_from(DECODERS),
)
def test_oversized_declarations(kind: str, headers: list[bytes], tail: bytes, decode: Decode) -> None:
    prefix = b"\x93" + _pack(PROTOCOL_VERSION) + _pack(kind) + b"\x81" + _pack("session_id")
    _only_protocol_errors(decode, prefix + b"".join(headers) + tail)


@FUZZ
@given(
    depth=st.integers(1, 3000),
    width=st.integers(0, 300),
    kind=st.sampled_from(["step", "wait", "close", "step_reply", "step_ack", "error"]),
    decode=st.sampled_from(DECODERS),
)
def test_deep_or_wide_msgpack(depth: int, width: int, kind: str, decode: Decode) -> None:
    nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]], past msgpack's own depth limit too
    wide = _pack([[]] * width)
    body = b"\x82" + _pack("session_id") + nested + _pack("route_rest") + wide
    _only_protocol_errors(decode, b"\x93" + _pack(PROTOCOL_VERSION) + _pack(kind) + body)


def _body(frame: bytes) -> tuple[int, str, dict[str, Any]]:
    version, kind, body = msgpack.unpackb(frame, raw=False)
    return version, kind, body


@FUZZ
@given(
    frame=st.sampled_from(VALID_FRAMES),
    changes=st.dictionaries(
        st.sampled_from(
            ["session_id", "position", "hidden", "start", "end", "max_length_tokens", "model_hash"]
            + ["route_rest", "timings", "closed", "payload", "reply_bytes", "dial_back_peer_id"]
            + ["timeout_s", "wait_result", "codec", "lossless"]
            + ["dial_back_maddrs", "dial_back_ok", "code", "message", "failed_peer_id", "missing_layers"]
            + ["num_layers", "free_cache_tokens", "peer_id", "received_bytes", "unknown_field"]
        ),
        VALUES,
        min_size=1,
        max_size=4,
    ),
    dropped=st.lists(st.sampled_from(["session_id", "hidden", "start", "code", "peer_id"]), max_size=2),
    version=st.one_of(st.just(PROTOCOL_VERSION), VALUES),
    decode=st.sampled_from(DECODERS),
)
def test_every_field_with_any_value(
    frame: bytes, changes: dict[str, Any], dropped: list[str], version: Any, decode: Decode
) -> None:
    _, kind, body = _body(frame)
    body.update(changes)
    for key in dropped:
        body.pop(key, None)
    _only_protocol_errors(decode, _pack([version, kind, body]))


DTYPES = st.sampled_from(["float32", "float16", "bfloat16", "int64", "float64", "uint8", "", "float32\0"])
SHAPES = st.lists(st.one_of(st.integers(-5, 70), NUMBERS), max_size=6)


@FUZZ
@given(
    kind=st.sampled_from(["step", "step_reply"]),
    dtype=st.one_of(DTYPES, VALUES),
    shape=st.one_of(SHAPES, VALUES),
    data=st.one_of(st.binary(max_size=600), VALUES),
    decode=st.sampled_from(DECODERS),
)
def test_tensors_with_wrong_dtypes_and_shapes(
    kind: str, dtype: Any, shape: Any, data: Any, decode: Decode
) -> None:
    frame = encode_request(VALID_REQUESTS[0]) if kind == "step" else encode_reply(VALID_REPLIES[0])
    _, _, body = _body(frame)
    body["hidden"] = {"dtype": dtype, "shape": shape, "data": data}
    _only_protocol_errors(decode, _pack([PROTOCOL_VERSION, kind, body]))


Q8_FIELDS = ["codec", "dtype", "shape", "data", "scales", "peaks", "peak_index", "unknown_field"]


@FUZZ
@given(
    kind=st.sampled_from(["step", "step_reply"]),
    changes=st.dictionaries(
        st.sampled_from(Q8_FIELDS), st.one_of(VALUES, st.binary(max_size=600)), min_size=1, max_size=4
    ),
    dropped=st.lists(st.sampled_from(Q8_FIELDS), max_size=2),
    decode=st.sampled_from(DECODERS),
)
def test_lighter_states_with_any_field(
    kind: str, changes: dict[str, Any], dropped: list[str], decode: Decode
) -> None:
    """q8 states (swarm.codec) with any of their fields replaced or missing: a ProtocolError, never another."""
    frame = encode_request(VALID_REQUESTS[2]) if kind == "step" else encode_reply(VALID_REPLIES[2])
    _, _, body = _body(frame)
    body["hidden"].update(changes)
    for key in dropped:
        body["hidden"].pop(key, None)
    _only_protocol_errors(decode, _pack([PROTOCOL_VERSION, kind, body]))
