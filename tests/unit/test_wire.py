"""Round trips of every wire message, and garbage input that must become a clear ProtocolError."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import (
    CapacityError,
    NoRouteError,
    ProtocolError,
    SessionError,
    SessionEvicted,
    VersionMismatch,
)
from swarm.wire import (
    DEFAULT_STEP_TIMEOUT_S,
    MAX_LAYER,
    MAX_LENGTH_TOKENS,
    MAX_TENSOR_BYTES,
    CacheStats,
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
    decode_reply,
    decode_request,
    decode_tensor,
    encode_reply,
    encode_request,
    encode_tensor,
)

pytestmark = pytest.mark.timeout(30)

ROUTE = (Hop("QmPeerA", ("/ip4/127.0.0.1/tcp/1/p2p/QmPeerA",), 2, 4), Hop("QmPeerB", (), 4, 6))


def _step(hidden: torch.Tensor | None = None, **overrides: object) -> StepRequest:
    fields: dict[str, object] = dict(
        session_id="abc123",
        position=5,
        hidden=torch.randn(3, 16) if hidden is None else hidden,
        start=0,
        end=2,
        max_length_tokens=64,
        model_hash="deadbeef",
        route_rest=ROUTE,
    )
    fields.update(overrides)
    return StepRequest(**fields)  # type: ignore[arg-type]


def _raw(kind: str, body: object, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, kind, body], use_bin_type=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_round_trip_keeps_dtype_and_bits(dtype: torch.dtype) -> None:
    tensor = torch.randn(5, 7).to(dtype)
    back = decode_tensor(encode_tensor(tensor))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_sixteen_bit_tensors_take_two_bytes_per_value() -> None:
    assert len(encode_tensor(torch.zeros(4, 8, dtype=torch.bfloat16))["data"]) == 64


def test_step_request_round_trip() -> None:
    request = _step()
    back = decode_request(encode_request(request))
    assert isinstance(back, StepRequest)
    assert torch.equal(back.hidden, request.hidden)
    assert (back.session_id, back.position, back.start, back.end) == ("abc123", 5, 0, 2)
    assert (back.max_length_tokens, back.model_hash) == (64, "deadbeef")
    assert back.route_rest == ROUTE


def test_other_requests_round_trip() -> None:
    assert decode_request(encode_request(CloseRequest("s1", ROUTE))) == CloseRequest("s1", ROUTE)
    close = CloseRequest("s1", ROUTE, origin="QmClient")
    assert decode_request(encode_request(close)) == close
    step = _step(origin="QmClient")
    assert decode_request(encode_request(step)).origin == "QmClient"  # type: ignore[union-attr]
    assert "origin" not in str(encode_request(_step()))  # absent on the wire when unset: the old bytes
    assert decode_request(encode_request(InfoRequest())) == InfoRequest()
    probe = ProbeRequest(b"x" * 1000, 10, "QmBack", ("/ip4/127.0.0.1/tcp/5",))
    assert decode_request(encode_request(probe)) == probe


def test_wait_result_steps_waits_and_acks_round_trip() -> None:
    request = _step(wait_result=True)
    back = decode_request(encode_request(request))
    assert isinstance(back, StepRequest) and back.wait_result
    assert not decode_request(encode_request(_step())).wait_result  # absent on the wire when unset
    assert decode_request(encode_request(StepWait("s1", 7, 12.5))) == StepWait("s1", 7, 12.5)
    ack = StepAck((HopTiming("QmA", 0, 2, 0.001, 0.01, 0.02),))
    assert decode_reply(encode_reply(ack)) == ack
    with pytest.raises(ProtocolError, match="wait_result must be a bool"):
        version, kind, body = msgpack.unpackb(encode_request(request), raw=False)
        decode_request(_raw(kind, body | {"wait_result": 1}, version))


def test_replies_round_trip() -> None:
    timings = (HopTiming("QmA", 0, 2, 0.001, 0.01, 0.02), HopTiming("QmB", 2, 4, 0.0, 0.5, 0.6))
    step = StepReply(torch.randn(1, 16), timings)
    back = decode_reply(encode_reply(step))
    assert isinstance(back, StepReply) and torch.equal(back.hidden, step.hidden) and back.timings == timings
    info = InfoReply("QmA", "alice", "tiny", "h", 4, 16, "float32", 0, 2, 100, 90, 1, "serving")
    traffic = (("announce", 100, 0), ("summary", 0, 2048))
    counted = InfoReply(
        "QmA", "alice", "tiny", "h", 4, 16, "float32", 0, 2, 100, 90, 1, "serving", 2, traffic
    )
    cached = replace(counted, cache=CacheStats(16, 10, 2, 6, 400, 384))
    for reply in (
        CloseReply(True),
        info,
        counted,
        cached,
        ProbeReply("QmA", 10, b"yy", True, ""),
        ProbeReply("QmA", 0),
        ErrorReply("capacity", "full", "QmB"),
    ):
        assert decode_reply(encode_reply(reply)) == reply


def test_error_reply_keeps_the_error_type_and_failed_peer() -> None:
    error = decode_reply(encode_reply(ErrorReply.from_error(CapacityError("cache full"), "QmA")))
    assert isinstance(error, ErrorReply)
    raised = error.to_error()
    assert isinstance(raised, CapacityError) and "cache full" in str(raised)
    assert raised.failed_peer_id == "QmA"
    downstream = SessionError("gone")
    downstream.failed_peer_id = "QmC"
    assert ErrorReply.from_error(downstream, "QmA").failed_peer_id == "QmC"  # the deepest failure is kept
    assert isinstance(ErrorReply("no_route", "x").to_error(), NoRouteError)
    evicted = decode_reply(encode_reply(ErrorReply.from_error(SessionEvicted("idle, cache short"), "QmA")))
    assert isinstance(evicted, ErrorReply) and evicted.code == "session_evicted"
    assert isinstance(evicted.to_error(), SessionEvicted)  # and so a SessionError: the client replays
    plain = ErrorReply.from_error(RuntimeError("boom"), "QmA")
    assert plain.code == "swarm_error" and "RuntimeError: boom" in plain.message


def test_no_route_error_keeps_its_missing_layers_across_the_wire() -> None:
    reply = decode_reply(encode_reply(ErrorReply.from_error(NoRouteError([4, 5, 9]), "QmA")))
    assert isinstance(reply, ErrorReply) and reply.missing_layers == (4, 5, 9)
    raised = reply.to_error()
    assert isinstance(raised, NoRouteError) and raised.missing_layers == [4, 5, 9]
    assert "4:6, 9:10" in str(raised) and raised.failed_peer_id == "QmA"
    # other errors carry none, and encode exactly as before the field existed
    plain = ErrorReply("capacity", "full", "QmB")
    assert "missing_layers" not in msgpack.unpackb(encode_reply(plain), raw=False)[2]


@pytest.mark.parametrize(
    "missing",
    ["4:6", [4, "5"], [True], [-1], [MAX_LAYER], list(range(MAX_LAYER + 1))],
    ids=["not-a-list", "a-string", "a-bool", "negative", "past-max-layer", "too-many"],
)
def test_bad_missing_layers_are_rejected_clearly(missing: object) -> None:
    body = {"code": "no_route", "message": "x", "failed_peer_id": None, "missing_layers": missing}
    with pytest.raises(ProtocolError, match="missing_layers"):
        decode_reply(_raw("error", body))


def test_version_mismatch_fails_fast() -> None:
    data = bytearray(encode_request(InfoRequest()))
    with pytest.raises(VersionMismatch, match="protocol version"):
        decode_request(_raw("info", {}, version=PROTOCOL_VERSION + 1))
    assert decode_request(bytes(data)) == InfoRequest()


def test_requests_and_replies_are_not_interchangeable() -> None:
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode_request(encode_reply(CloseReply(True)))
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode_reply(encode_request(InfoRequest()))


def _step_body(**overrides: object) -> dict[str, object]:
    body = msgpack.unpackb(encode_request(_step()), raw=False)[2]
    body.update(overrides)
    return body


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"position": -1}, "position"),
        ({"max_length_tokens": -5}, "max_length_tokens"),
        ({"max_length_tokens": MAX_LENGTH_TOKENS + 1}, "max_length_tokens"),
        ({"max_length_tokens": 4}, "past max_length_tokens"),
        ({"start": 3, "end": 3}, "empty layer range"),
        ({"end": "2"}, "must be an int"),
        ({"session_id": 5}, "must be a string"),
        ({"session_id": "x" * 1000}, "over the 128 limit"),
        ({"hidden": {"dtype": "int64", "shape": [3, 16], "data": b"\0" * 384}}, "unsupported dtype"),
        ({"hidden": {"dtype": "float32", "shape": [3, 16], "data": b"\0" * 10}}, "needs 192 bytes"),
        ({"hidden": {"dtype": "float32", "shape": [48], "data": b"\0" * 192}}, "tokens, hidden_size"),
        ({"hidden": {"dtype": "float32", "shape": [3, -16], "data": b""}}, "positive int"),
        ({"hidden": {"dtype": "float32", "shape": [65536, 1024], "data": b""}}, "tensor limit"),
        ({"hidden": "not a tensor"}, "must be a map"),
        ({"route_rest": [{"peer_id": "Qm", "maddrs": "x", "start": 0, "end": 1}]}, "maddrs"),
        ({"route_rest": "nope"}, "route_rest"),
    ],
)
def test_bad_step_fields_are_rejected_clearly(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_request(_raw("step", _step_body(**overrides)))


def test_nan_hidden_is_rejected() -> None:
    hidden = torch.randn(2, 16)
    hidden[1, 3] = float("nan")
    with pytest.raises(ProtocolError, match="NaN"):
        decode_request(encode_request(_step(hidden, position=0)))


def test_oversize_tensor_is_refused_before_allocation() -> None:
    side = int((MAX_TENSOR_BYTES // 4) ** 0.5) + 8
    body = {"dtype": "float32", "shape": [side, side], "data": b"\0" * 8}
    with pytest.raises(ProtocolError, match="tensor limit"):
        decode_tensor(body)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x93\x01", b"garbage bytes that are not msgpack \xff\xfe", msgpack.packb({"a": 1})],
)
def test_garbage_bytes_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_request(data)
    with pytest.raises(ProtocolError):
        decode_reply(data)


def test_random_mutations_never_escape_as_other_errors() -> None:
    rng = random.Random(0)
    good = encode_request(_step())
    refused = 0
    for _ in range(500):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cut = rng.randrange(len(data) + 1) if rng.random() < 0.3 else len(data)
        try:
            decode_request(bytes(data[:cut]))
        except ProtocolError:
            refused += 1  # any other exception fails the test
    assert refused > 0  # the mutations reached the validation, not only the tensor bytes


def test_unsupported_send_dtype_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="cannot send"):
        encode_tensor(torch.zeros(2, 2, dtype=torch.int64))


def test_a_steps_deadline_travels_and_defaults_when_an_older_sender_omits_it() -> None:
    back = decode_request(encode_request(_step(timeout_s=2.5)))
    assert isinstance(back, StepRequest) and back.timeout_s == 2.5
    body = msgpack.unpackb(encode_request(_step()), raw=False)[2]
    del body["timeout_s"]
    old = decode_request(_raw("step", body))
    assert isinstance(old, StepRequest) and old.timeout_s == DEFAULT_STEP_TIMEOUT_S
    for bad in (0, -1.0, 1e9, float("nan"), "soon"):
        with pytest.raises(ProtocolError, match="timeout_s"):
            decode_request(_raw("step", {**body, "timeout_s": bad}))


def test_info_reply_background_bytes_are_checked() -> None:
    info = InfoReply("QmA", "alice", "tiny", "h", 4, 16, "float32", 0, 2, 100, 90, 1, "serving")
    body = encode_reply(info)
    assert decode_reply(body) == info  # absent when empty: the old bytes
    for bad in (
        [["announce", -1, 0]],
        [["announce", 1]],
        [[1, 2, 3]],
        [["x" * 33, 0, 0]],
        [["a", 0, 0]] * 17,
    ):
        raw = msgpack.unpackb(body, raw=False)
        raw[2]["background_bytes"] = bad
        with pytest.raises(ProtocolError):
            decode_reply(msgpack.packb(raw, use_bin_type=True))


def test_an_info_reply_with_a_malformed_cache_is_refused() -> None:
    info = InfoReply("QmA", "alice", "tiny", "h", 4, 16, "float32", 0, 2, 100, 90, 1, "serving")
    version, kind, body = msgpack.unpackb(encode_reply(replace(info, cache=CacheStats(16, 1, 0, 5, 9, 0))))
    for bad in ([16, 1, 0, 5, 9], [16, 1, 0, 5, 9, -1], "16", [16, 1, 0, 5, 9, True]):
        frame = msgpack.packb([version, kind, {**body, "cache": bad}])
        with pytest.raises(ProtocolError, match="cache|prefix_tokens_shared"):
            decode_reply(frame)
