"""Every message that crosses the network between a client and a peer, or between two peers.

A message on the wire is a msgpack array ``[protocol_version, kind, body]`` where ``body`` is a map. Tensors are
maps ``{"dtype", "shape", "data"}`` with the raw little-endian bytes in ``data`` (never pickle); a model that runs
in 16-bit sends 16-bit hidden states. ``decode_*`` validates everything at the boundary and raises
``ProtocolError`` (or ``VersionMismatch``) with a message that says what was wrong, so a handler never sees
malformed input and a peer never crashes on it.

The package: ``limits`` (what a peer accepts), ``messages`` (each request and reply), ``tensors`` (tensors and
hidden states on the wire), ``fields`` (checks of a body's fields); here, the bodies and envelopes, and every
public name of the others.

Requests and their replies:

    StepRequest    -> StepReply     one inference step of a session, forwarded along ``route_rest``
                   -> StepAck       the same, sent with ``wait_result``: the last hop's output goes to a StepWait
    StepWait       -> StepReply     the output of one step, from the route's last hop straight to the client
    StepBatch      -> StepBatchReply  several steps for one hop in one message (a hop forwarding, a client's round)
    StepWaits      -> StepBatchReply  several waits for one last hop in one message (a client's round)
    CloseRequest   -> CloseReply    close a session on this peer and every hop in ``route_rest``
    InfoRequest    -> InfoReply     what the peer serves right now
    ProbeRequest   -> ProbeReply    link measurement (payload for bandwidth, empty for RTT) and dial-back
    HandoverRequest -> HandoverReply  one chunk of a session's KV cache, from the peer that held it to its successor
    MoveRequest    -> MoveReply     a client asks a peer of its route to hand its session to another peer
    any request    -> ErrorReply    a SwarmError with its code, so it keeps its type across the wire
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, replace
from typing import Any

import msgpack
import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import ProtocolError, VersionMismatch
from swarm.wire.fields import (
    _background_bytes,
    _cache_stats,
    _encode_route,
    _flag,
    _float,
    _int,
    _layers,
    _maddrs,
    _map,
    _origin,
    _route,
    _str,
    _timeout,
)
from swarm.wire.limits import (
    _MAX_KIND_BYTES,
    _REPLY_ARRAY_LEN,
    _REQUEST_ARRAY_LEN,
    _UNPACK_LIMITS,
    DEFAULT_STEP_TIMEOUT_S,
    MAX_BATCH_STEPS,
    MAX_FORWARDED_STEPS,
    MAX_HIDDEN_SIZE,
    MAX_LAYER,
    MAX_LENGTH_TOKENS,
    MAX_MADDRS,
    MAX_MAP_FIELDS,
    MAX_MESSAGE_BYTES,
    MAX_OBJECTS,
    MAX_POSITION,
    MAX_PROBE_BYTES,
    MAX_ROUTE_HOPS,
    MAX_STEP_TIMEOUT_S,
    MAX_STRUCTURE_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    MAX_TRAFFIC_CAUSES,
    UNKNOWN_KIND,
    WIRE_DTYPES,
)
from swarm.wire.messages import (
    _REPLY_KIND_NAMES,
    _REPLY_KINDS,
    _REQUEST_KIND_NAMES,
    _REQUEST_KINDS,
    REPLY_FOR,
    CacheStats,
    CloseReply,
    CloseRequest,
    ErrorReply,
    HandoverReply,
    HandoverRequest,
    Hop,
    HopTiming,
    InfoReply,
    InfoRequest,
    MoveReply,
    MoveRequest,
    ProbeReply,
    ProbeRequest,
    Reply,
    Request,
    StepAck,
    StepBatch,
    StepBatchReply,
    StepReply,
    StepRequest,
    StepWait,
    StepWaits,
    request_verb,
)
from swarm.wire.tensors import (
    _codec,
    _hidden,
    decode_hidden,
    decode_tensor,
    encode_hidden,
    encode_tensor,
)

# ---------------------------------------------------------------- bodies


def _encode_body(msg: Request | Reply) -> dict[str, Any]:
    if isinstance(msg, StepRequest) and msg.resend_tokens:
        return _encode_resend(msg)
    if isinstance(msg, StepRequest):
        return {
            "session_id": msg.session_id,
            "position": msg.position,
            "hidden": encode_hidden(msg.hidden, msg.codec),
            "start": msg.start,
            "end": msg.end,
            "max_length_tokens": msg.max_length_tokens,
            "model_hash": msg.model_hash,
            "route_rest": _encode_route(msg.route_rest),
            "timeout_s": msg.timeout_s,
        } | _absent_when_unset(
            wait_result=msg.wait_result,
            origin=msg.origin,
            batch_id=msg.batch_id,
            batch_size=msg.batch_size if msg.batch_size != 1 else 0,
            lossless=msg.lossless,
        )
    if isinstance(msg, StepBatch):
        return {"steps": [_encode_body(step) for step in msg.steps]}
    if isinstance(msg, StepBatchReply):
        return {"outcomes": [[_REPLY_KINDS[type(o)], _encode_body(o)] for o in msg.outcomes]}
    if isinstance(msg, StepReply):
        return {"hidden": encode_hidden(msg.hidden, msg.codec), "timings": _encode_timings(msg.timings)}
    if isinstance(msg, StepAck):
        return {"timings": _encode_timings(msg.timings)}
    if isinstance(msg, StepWait):
        body = {"session_id": msg.session_id, "position": msg.position, "timeout_s": msg.timeout_s}
        return body | _absent_when_unset(codec=msg.codec if msg.codec != "exact" else "")
    if isinstance(msg, StepWaits):
        return {"waits": [_encode_body(wait) for wait in msg.waits]}
    if isinstance(msg, CloseRequest):
        return {
            "session_id": msg.session_id,
            "route_rest": _encode_route(msg.route_rest),
        } | _absent_when_unset(origin=msg.origin)
    if isinstance(msg, ProbeRequest | ProbeReply):
        body = {k: getattr(msg, k) for k in msg.__dataclass_fields__}
        if isinstance(msg, ProbeRequest):
            body["dial_back_maddrs"] = list(msg.dial_back_maddrs)
        return body
    if isinstance(msg, ErrorReply):
        body = {"code": msg.code, "message": msg.message, "failed_peer_id": msg.failed_peer_id}
        if msg.missing_layers:  # only no_route errors carry it; the others keep their old bytes
            body["missing_layers"] = list(msg.missing_layers)
        return body | _absent_when_unset(successor_id=msg.successor_id)
    if isinstance(msg, HandoverRequest):
        fields = {k: getattr(msg, k) for k in msg.__dataclass_fields__ if k not in ("keys", "values")}
        return fields | {"keys": encode_tensor(msg.keys), "values": encode_tensor(msg.values)}
    if isinstance(msg, MoveRequest):
        body = {"session_id": msg.session_id, "target_peer_id": msg.target_peer_id}
        if msg.layers is not None:  # a whole session's move keeps its old bytes
            body |= {"start": msg.layers[0], "end": msg.layers[1]}
        return body | {"target_maddrs": list(msg.target_maddrs)} | _absent_when_unset(origin=msg.origin)
    if isinstance(msg, InfoReply):
        fields = {
            k: getattr(msg, k) for k in msg.__dataclass_fields__ if k not in ("background_bytes", "cache")
        }
        cache = list(astuple(msg.cache)) if msg.cache is not None else None
        return fields | _absent_when_unset(
            background_bytes=[list(c) for c in msg.background_bytes], cache=cache
        )
    # CloseReply, InfoRequest: flat fields of plain types.
    return {k: getattr(msg, k) for k in msg.__dataclass_fields__}


def _absent_when_unset(**fields: object) -> dict[str, object]:
    """Optional fields, left out when unset so a message without them keeps its old bytes."""
    return {k: v for k, v in fields.items() if v}


def _encode_timings(timings: tuple[HopTiming, ...]) -> list[list[Any]]:
    return [[t.peer_id, t.start, t.end, t.queue_s, t.compute_s, t.total_s] for t in timings]


def _decode_timings(value: object) -> tuple[HopTiming, ...]:
    if not isinstance(value, list) or len(value) > MAX_ROUTE_HOPS:
        raise ProtocolError("timings must be a list of hop timings")
    timings = []
    for item in value:
        if not isinstance(item, list) or len(item) != 6:
            raise ProtocolError("each timing must be [peer_id, start, end, queue_s, compute_s, total_s]")
        t = dict(zip(("peer_id", "start", "end", "queue_s", "compute_s", "total_s"), item, strict=True))
        timings.append(
            HopTiming(
                _str(t, "peer_id", "timing", 128),
                _int(t, "start", "timing", 0, MAX_LAYER),
                _int(t, "end", "timing", 0, MAX_LAYER),
                _float(t, "queue_s", "timing"),
                _float(t, "compute_s", "timing"),
                _float(t, "total_s", "timing"),
            )
        )
    return tuple(timings)


def _encode_resend(msg: StepRequest) -> dict[str, Any]:
    body = _encode_body(replace(msg, resend_tokens=0, codec="exact"))
    del body["hidden"]
    return body | {"hidden_size": int(msg.hidden.shape[-1]), "resend_tokens": msg.resend_tokens}


def _resend_hidden(body: dict[str, Any], w: str) -> tuple[int, torch.Tensor]:
    """A resend's token count and its empty hidden [0, H]; ProtocolError if it also carries states or
    sends nothing on."""
    if "hidden" in body:
        raise ProtocolError(f"{w}: a resend carries no hidden states (it sends the hop's own on)")
    if not body.get("route_rest"):
        raise ProtocolError(f"{w}: a resend needs hops to send to (route_rest is empty)")
    tokens = _int(body, "resend_tokens", w, 1, MAX_TOKENS)
    return tokens, torch.empty(0, _int(body, "hidden_size", w, 1, MAX_HIDDEN_SIZE))


def _decode_step(body: dict[str, Any]) -> StepRequest:
    w = "step"
    start, end = _layers(body, w)
    position = _int(body, "position", w, 0, MAX_POSITION)
    max_length = _int(body, "max_length_tokens", w, 1, MAX_LENGTH_TOKENS)
    resend, codec = 0, "exact"
    if "resend_tokens" in body:
        resend, hidden = _resend_hidden(body, w)
    else:
        hidden, codec = _hidden(body)
    if position + (resend or hidden.shape[0]) > max_length:
        raise ProtocolError(
            f"step: position {position} + {resend or hidden.shape[0]} tokens is past max_length_tokens "
            f"{max_length}"
        )
    return StepRequest(
        session_id=_str(body, "session_id", w, 128),
        position=position,
        hidden=hidden,
        start=start,
        end=end,
        max_length_tokens=max_length,
        model_hash=_str(body, "model_hash", w, 256),
        route_rest=_route(body),
        timeout_s=_timeout(body, w),
        wait_result=_flag(body, "wait_result", w),
        origin=_origin(body, w),
        resend_tokens=resend,
        batch_id=_str(body, "batch_id", w, 64) if "batch_id" in body else "",
        batch_size=_int(body, "batch_size", w, 1, MAX_BATCH_STEPS) if "batch_size" in body else 1,
        codec=codec,
        lossless=_flag(body, "lossless", w),
    )


def _items(body: dict[str, Any], key: str) -> list[Any]:
    items = body.get(key)
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_FORWARDED_STEPS:
        raise ProtocolError(f"{key} must be a list of 1 to {MAX_FORWARDED_STEPS} items")
    return items


def _decode_outcome(item: object) -> StepAck | StepReply | ErrorReply:
    if not isinstance(item, list) or len(item) != 2 or item[0] not in ("step_ack", "step_reply", "error"):
        raise ProtocolError("steps_reply.outcomes must hold [step_ack | step_reply | error, body] pairs")
    outcome = _decode_body(item[0], _map(item[1], item[0]))
    assert isinstance(outcome, StepAck | StepReply | ErrorReply)
    return outcome


def _decode_wait(body: dict[str, Any]) -> StepWait:
    w = "wait"
    return StepWait(
        _str(body, "session_id", w, 128),
        _int(body, "position", w, 0, MAX_POSITION),
        _timeout(body, w),
        _codec(body, w),
    )


def _decode_handover(body: dict[str, Any]) -> HandoverRequest:
    """A chunk's numbers, checked against each other; its shapes against the model are the receiver's check."""
    w = "handover"
    start, end = _layers(body, w)
    max_length = _int(body, "max_length_tokens", w, 1, MAX_LENGTH_TOKENS)
    position = _int(body, "position", w, 1, max_length)
    layer = _int(body, "layer", w, start, end - 1)
    token_start = _int(body, "token_start", w, 0, position - 1)
    keys, values = decode_tensor(body.get("keys"), "keys"), decode_tensor(body.get("values"), "values")
    if keys.dim() != 3 or keys.shape != values.shape or keys.dtype != values.dtype:
        raise ProtocolError(
            f"{w}: keys and values must be alike [kv_heads, n, head_dim], got "
            f"{list(keys.shape)} and {list(values.shape)}"
        )
    if token_start + keys.shape[1] > position:
        raise ProtocolError(f"{w}: tokens {token_start}+{keys.shape[1]} are past position {position}")
    return HandoverRequest(
        session_id=_str(body, "session_id", w, 128),
        origin=_str(body, "origin", w, 128),
        position=position,
        max_length_tokens=max_length,
        start=start,
        end=end,
        model_hash=_str(body, "model_hash", w, 256),
        layer=layer,
        token_start=token_start,
        keys=keys,
        values=values,
    )


def _decode_move(body: dict[str, Any]) -> MoveRequest:
    w = "move"
    target = _str(body, "target_peer_id", w, 128)
    if not target:
        raise ProtocolError("move.target_peer_id must name a peer")
    maddrs = _maddrs(body.get("target_maddrs", []), w)
    layers = _layers(body, w) if "start" in body or "end" in body else None
    return MoveRequest(_str(body, "session_id", w, 128), target, maddrs, _origin(body, w), layers)


def _decode_move_reply(body: dict[str, Any]) -> MoveReply:
    return MoveReply(
        _int(body, "tokens", "move_reply", 0, MAX_POSITION), _int(body, "kv_bytes", "move_reply")
    )


def _decode_handover_reply(body: dict[str, Any]) -> HandoverReply:
    return HandoverReply(_flag(body, "installed", "handover_reply"))


# the messages that move a session's cache between peers (swarm.peer.handover)
_TRANSFER_DECODERS: dict[str, Callable[[dict[str, Any]], Request | Reply]] = {
    "handover": _decode_handover,
    "handover_reply": _decode_handover_reply,
    "move": _decode_move,
    "move_reply": _decode_move_reply,
}


def _decode_body(kind: str, body: dict[str, Any]) -> Request | Reply:
    w = kind
    if kind == "step":
        return _decode_step(body)
    if kind == "step_reply":
        hidden, codec = _hidden(body)
        return StepReply(hidden, _decode_timings(body.get("timings", [])), codec)
    if kind == "step_ack":
        return StepAck(_decode_timings(body.get("timings", [])))
    if kind == "steps":
        return StepBatch(tuple(_decode_step(_map(step, "steps")) for step in _items(body, "steps")))
    if kind == "steps_reply":
        return StepBatchReply(tuple(_decode_outcome(item) for item in _items(body, "outcomes")))
    if kind == "wait":
        return _decode_wait(body)
    if kind == "waits":
        return StepWaits(tuple(_decode_wait(_map(wait, "waits")) for wait in _items(body, "waits")))
    if kind == "close":
        return CloseRequest(_str(body, "session_id", w, 128), _route(body), _origin(body, w))
    if kind == "close_reply":
        closed = body.get("closed")
        if not isinstance(closed, bool):
            raise ProtocolError("close_reply.closed must be a bool")
        return CloseReply(closed)
    if kind == "info":
        return InfoRequest()
    if kind == "info_reply":
        ints = (
            *("num_layers", "hidden_size", "range_start", "range_end", "cache_tokens_total"),
            *("free_cache_tokens", "active_sessions", "protocol_version"),
        )
        strs = ("peer_id", "name", "model_name", "model_hash", "dtype", "state")
        fields: dict[str, Any] = {k: _int(body, k, w) for k in ints}
        fields.update({k: _str(body, k, w) for k in strs})
        return InfoReply(**fields, background_bytes=_background_bytes(body, w), cache=_cache_stats(body, w))
    if kind == "probe":
        payload = body.get("payload", b"")
        if not isinstance(payload, bytes) or len(payload) > MAX_PROBE_BYTES:
            raise ProtocolError(f"probe.payload must be at most {MAX_PROBE_BYTES} bytes")
        return ProbeRequest(
            payload=payload,
            reply_bytes=_int(body, "reply_bytes", w, 0, MAX_PROBE_BYTES),
            dial_back_peer_id=_str(body, "dial_back_peer_id", w, 128),
            dial_back_maddrs=_maddrs(body.get("dial_back_maddrs", []), w),
        )
    if kind == "probe_reply":
        payload = body.get("payload", b"")
        ok = body.get("dial_back_ok")
        if not isinstance(payload, bytes) or not (ok is None or isinstance(ok, bool)):
            raise ProtocolError("probe_reply: payload must be bytes and dial_back_ok a bool or nil")
        return ProbeReply(
            peer_id=_str(body, "peer_id", w, 128),
            received_bytes=_int(body, "received_bytes", w, 0, MAX_PROBE_BYTES),
            payload=payload,
            dial_back_ok=ok,
            dial_back_error=_str(body, "dial_back_error", w),
        )
    if kind == "error":
        failed = body.get("failed_peer_id")
        if failed is not None and not isinstance(failed, str):
            raise ProtocolError("error.failed_peer_id must be a string or nil")
        missing = body.get("missing_layers", [])  # absent from every error but no_route
        if not isinstance(missing, list) or len(missing) > MAX_LAYER:
            raise ProtocolError(f"error.missing_layers must be a list of at most {MAX_LAYER} layers")
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_LAYER for x in missing):
            raise ProtocolError(f"error.missing_layers must hold layer numbers in [0, {MAX_LAYER})")
        successor = _str(body, "successor_id", w, 128) if "successor_id" in body else None
        code, message = _str(body, "code", w, 64), _str(body, "message", w)
        return ErrorReply(code, message, failed, tuple(missing), successor)
    transfer = _TRANSFER_DECODERS.get(kind)
    if transfer is not None:
        return transfer(body)
    raise ProtocolError(f"unknown message kind {kind!r}")


# ---------------------------------------------------------------- envelopes


def _encode(kind: str, msg: Request | Reply) -> bytes:
    data: bytes = msgpack.packb([PROTOCOL_VERSION, kind, _encode_body(msg)], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    return data


class _ObjectBudget:
    """msgpack hooks that count container elements as they are built and stop the decoder past MAX_OBJECTS."""

    def __init__(self) -> None:
        self.left = MAX_OBJECTS

    def _spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise ProtocolError(f"message holds over {MAX_OBJECTS} objects")

    def list_hook(self, items: list[Any]) -> list[Any]:
        self._spend(len(items))
        return items

    def object_hook(self, fields: dict[str, Any]) -> dict[str, Any]:
        self._spend(len(fields))
        return fields


def _peek(data: bytes | bytearray | memoryview, kinds: frozenset[str]) -> str:
    """The kind of message ``data`` declares, read from its first bytes only (version checked first)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64, max_str_len=32, max_bin_len=0, max_ext_len=0)
    unpacker.feed(bytes(data[:64]))
    try:
        if unpacker.read_array_header() != 3:
            raise ValueError("not a 3-element array")
        version, kind = unpacker.unpack(), unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError("a message must be a msgpack array [protocol_version, kind, body]") from None
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError(f"protocol version must be an int, got {version!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version} received, this side speaks {PROTOCOL_VERSION}")
    if not isinstance(kind, str) or kind not in kinds:
        raise ProtocolError(f"{UNKNOWN_KIND} {kind!r}; expected one of {sorted(kinds)}")
    return kind


def _decode(data: bytes, kinds: frozenset[str], max_array_len: int) -> Request | Reply:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    kind = _peek(data, kinds)
    limit = _MAX_KIND_BYTES.get(kind, MAX_STRUCTURE_BYTES)
    if len(data) > limit:
        raise ProtocolError(f"{kind} message of {len(data)} bytes is over its {limit}-byte limit")
    budget = _ObjectBudget()
    try:
        envelope = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            list_hook=budget.list_hook,
            object_hook=budget.object_hook,
            max_array_len=max_array_len,
            **_UNPACK_LIMITS,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError(f"not a valid msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(envelope, list) or len(envelope) != 3:
        raise ProtocolError("a message must be a msgpack array [protocol_version, kind, body]")
    return _decode_body(kind, _map(envelope[2], kind))


def encode_request(request: Request) -> bytes:
    kind = _REQUEST_KINDS.get(type(request))
    if kind is None:
        raise TypeError(f"not a request: {type(request).__name__}")
    return _encode(kind, request)


def decode_request(data: bytes) -> Request:
    msg = _decode(data, _REQUEST_KIND_NAMES, _REQUEST_ARRAY_LEN)
    return msg  # type: ignore[return-value]


def encode_reply(reply: Reply) -> bytes:
    kind = _REPLY_KINDS.get(type(reply))
    if kind is None:
        raise TypeError(f"not a reply: {type(reply).__name__}")
    return _encode(kind, reply)


def decode_reply(data: bytes) -> Reply:
    msg = _decode(data, _REPLY_KIND_NAMES, _REPLY_ARRAY_LEN)
    return msg  # type: ignore[return-value]


__all__ = [
    "CacheStats",
    "CloseReply",
    "CloseRequest",
    "DEFAULT_STEP_TIMEOUT_S",
    "ErrorReply",
    "HandoverReply",
    "HandoverRequest",
    "Hop",
    "HopTiming",
    "InfoReply",
    "InfoRequest",
    "MAX_BATCH_STEPS",
    "MAX_FORWARDED_STEPS",
    "MAX_HIDDEN_SIZE",
    "MAX_LAYER",
    "MAX_LENGTH_TOKENS",
    "MAX_MADDRS",
    "MAX_MAP_FIELDS",
    "MAX_MESSAGE_BYTES",
    "MAX_OBJECTS",
    "MAX_POSITION",
    "MAX_PROBE_BYTES",
    "MAX_ROUTE_HOPS",
    "MAX_STEP_TIMEOUT_S",
    "MAX_STRUCTURE_BYTES",
    "MAX_TENSOR_BYTES",
    "MAX_TEXT_CHARS",
    "MAX_TOKENS",
    "MAX_TRAFFIC_CAUSES",
    "MoveReply",
    "MoveRequest",
    "ProbeReply",
    "ProbeRequest",
    "REPLY_FOR",
    "Reply",
    "Request",
    "StepAck",
    "StepBatch",
    "StepBatchReply",
    "StepReply",
    "StepRequest",
    "StepWait",
    "StepWaits",
    "UNKNOWN_KIND",
    "WIRE_DTYPES",
    "decode_hidden",
    "decode_reply",
    "decode_request",
    "decode_tensor",
    "encode_hidden",
    "encode_reply",
    "encode_request",
    "encode_tensor",
    "request_verb",
]
