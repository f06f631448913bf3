"""Every message that crosses the network between a client and a peer, or between two peers.

A message on the wire is a msgpack array ``[protocol_version, kind, body]`` where ``body`` is a map. Tensors are
maps ``{"dtype", "shape", "data"}`` with the raw little-endian bytes in ``data`` (never pickle); a model that runs
in 16-bit sends 16-bit hidden states. ``decode_*`` validates everything at the boundary and raises
``ProtocolError`` (or ``VersionMismatch``) with a message that says what was wrong, so a handler never sees
malformed input and a peer never crashes on it.

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

import math
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from typing import Any

import msgpack
import numpy as np
import torch

from swarm import PROTOCOL_VERSION
from swarm.codec import CODECS, bytes_per_token, dequantize_q8, pack_q8, to_f16, unpack_q8
from swarm.errors import (
    NoRouteError,
    ProtocolError,
    SessionMoved,
    SwarmError,
    VersionMismatch,
    error_from_code,
)
from swarm.types import DTYPE_BYTES

# Limits on what a peer accepts; anything past them is a ProtocolError, not an allocation.
MAX_TENSOR_BYTES = 192 * 1024**2  # one tensor's raw data
MAX_TOKENS = 65_536  # tokens in one step (the T of hidden[T, H])
MAX_HIDDEN_SIZE = 65_536
MAX_LENGTH_TOKENS = 1 << 20  # a session longer than this is absurd for any model we serve
MAX_POSITION = MAX_LENGTH_TOKENS
MAX_LAYER = 10_000
MAX_ROUTE_HOPS = 256
MAX_MADDRS = 32
MAX_TEXT_CHARS = 4096
MAX_PROBE_BYTES = 64 * 1024**2
MAX_BATCH_STEPS = 1024  # a client's decode steps sent together (StepRequest.batch_size)
# how a peer refuses a message kind it does not know (one of a later release): the sender may then send as before
UNKNOWN_KIND = "unexpected message kind"
MAX_FORWARDED_STEPS = 256  # steps in one StepBatch (under the request's longest list, _REQUEST_ARRAY_LEN)
MAX_MAP_FIELDS = 32  # the widest message, InfoReply, has 16 fields
MAX_TRAFFIC_CAUSES = 16  # InfoReply.background_bytes entries
# Everything of a message but its tensor data or probe payload: the biggest legitimate one is a full route
# (MAX_ROUTE_HOPS hops of MAX_MADDRS multiaddrs of 512 characters: about 4.3 MB).
MAX_STRUCTURE_BYTES = 8 * 1024**2
MAX_MESSAGE_BYTES = MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES  # whole encoded message, streams included
# Container elements in one message: a full route has about 9,500, an ErrorReply up to MAX_LAYER layers.
# msgpack builds one Python object per element (~60 bytes for an empty list), so this bounds what a frame can
# make the decoder allocate beyond its own bytes.
MAX_OBJECTS = 4 * MAX_LAYER
DEFAULT_STEP_TIMEOUT_S = 60.0  # a step's deadline when its sender names none
MAX_STEP_TIMEOUT_S = 3600.0
# What each kind of message may weigh, checked against the frame's size before it is unpacked.
_MAX_KIND_BYTES = {
    "step": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,
    "step_reply": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,
    "steps": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,  # the steps' tensors together
    "steps_reply": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,
    "probe": MAX_PROBE_BYTES + MAX_STRUCTURE_BYTES,
    "probe_reply": MAX_PROBE_BYTES + MAX_STRUCTURE_BYTES,
}
# msgpack's own limits, from the ones above: a string, bin, array or map past them is refused by its header,
# before anything is allocated for it. msgpack allocates a declared array before reading its elements and
# nests up to 1024 deep, so the array limit is the longest list each direction carries: requests at most a
# route (MAX_ROUTE_HOPS), replies ErrorReply.missing_layers (MAX_LAYER).
_UNPACK_LIMITS: dict[str, int] = {
    "max_bin_len": max(MAX_TENSOR_BYTES, MAX_PROBE_BYTES),
    "max_str_len": 4 * MAX_TEXT_CHARS,  # UTF-8 bytes of the longest text field
    "max_map_len": MAX_MAP_FIELDS,
    "max_ext_len": 0,  # no message uses ext types
}
_REQUEST_ARRAY_LEN = MAX_ROUTE_HOPS + 1
_REPLY_ARRAY_LEN = MAX_LAYER + 1  # one past, so a too-long list gets its field's own error

WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class Hop:
    """One remaining hop of a route: the peer and the layers [start, end) it must compute."""

    peer_id: str
    maddrs: tuple[str, ...]
    start: int
    end: int


@dataclass(frozen=True)
class HopTiming:
    """Where the time of one hop went, for benchmarks (seconds, measured on that peer)."""

    peer_id: str
    start: int
    end: int
    queue_s: float  # waiting for the executor thread
    compute_s: float  # inside BlockRange.forward
    total_s: float  # from request decoded to reply ready, downstream hops included


@dataclass(frozen=True)
class StepRequest:
    """One step of session ``session_id``: hidden[T, H] at token ``position`` through layers [start, end).

    The first step a peer sees for an unknown session opens it with room for ``max_length_tokens``; later steps
    reuse it. The same session id is used on every hop. ``route_rest`` are the hops after this one: the peer
    pushes its output to ``route_rest[0]`` itself and returns what the last hop computed. ``timeout_s`` is what
    is left of the caller's deadline: each hop stops working on the step once it has passed, and passes on
    what is left of it, so a client's deadline bounds the whole route's work.
    """

    session_id: str
    position: int
    hidden: torch.Tensor
    start: int
    end: int
    max_length_tokens: int
    model_hash: str
    route_rest: tuple[Hop, ...] = ()
    timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    # The client waits for the output at the last hop (StepWait) instead of down the chain: each hop answers
    # its caller with a StepAck once the next hop has accepted the step, so relays are off the critical path.
    wait_result: bool = False
    # The client whose session this is, as the first hop authenticated it ("" from the client itself): the hops
    # after it key the session by it, so a session survives a change of the hop before them (failover).
    origin: str = ""
    # A resend (> 0, from the client only): this hop computes nothing; it sends its logged outputs for positions
    # [position, position + resend_tokens) on to ``route_rest`` as an ordinary step (swarm.peer.outputs), so a
    # failover refills only the stages it replaced. ``hidden`` is then [0, H]: on the wire, only H travels.
    resend_tokens: int = 0
    # The decode steps of other sessions sent together with this one: a client's round of its batched head, or
    # the lone steps one forward call of the hop before computed for this hop: ``batch_size`` steps in all,
    # under ``batch_id`` (a group of its sender's). A hop's executor waits a moment for the rest of them
    # (ExecutorConfig.group_window_s), so they run as one forward call instead of splitting by arrival.
    batch_id: str = ""
    batch_size: int = 1
    # How ``hidden`` travels on this hop (swarm.codec): "exact" (the model's dtype), "f16" or "q8". Decoded,
    # it says how it came, and ``hidden`` is what the sender sent, as near as the codec keeps it.
    codec: str = "exact"
    # Every hop sends this step's states on exact, whatever its own setting: a spot-check's route check
    # compares the route's answer with the stages' answers run alone (client.spot).
    lossless: bool = False


@dataclass(frozen=True)
class StepAck:
    """A step with ``wait_result`` accepted by this hop and every later one (their timings so far)."""

    timings: tuple[HopTiming, ...] = ()


@dataclass(frozen=True)
class StepBatch:
    """Decode steps of several sessions for the same next hop, forwarded by the hop before it in one message.

    Each runs as its own ``rpc_step`` (its own deadline, session and route) and is answered as one: a StepAck
    (``wait_result``) or the route's output (a relayed step). The reply comes once every step is answered, so a
    sender holds together only decode steps on the same remaining route (swarm.peer.forwarding). A hop that
    does not know this kind answers ProtocolError (UNKNOWN_KIND), and the sender then sends them one by one."""

    steps: tuple[StepRequest, ...]


@dataclass(frozen=True)
class StepBatchReply:
    """One outcome per step of a StepBatch, in its order: what rpc_step answered it, or its error."""

    outcomes: tuple[StepAck | StepReply | ErrorReply, ...]


@dataclass(frozen=True)
class StepWait:
    """The output of step ``position`` of ``session_id``, once the route's last hop has computed it.

    The session id is a random secret of the client, known only to the hops of its route; a wait names no
    remote peer, so it is the one way a hop's output reaches the client without passing back along the chain.
    """

    session_id: str
    position: int
    timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    codec: str = "exact"  # how the output travels back to the waiting client (StepReply.codec)


@dataclass(frozen=True)
class StepWaits:
    """The waits of a client's round for the outputs of its steps at the same last hop, in one message.

    Each runs as its own ``rpc_wait`` and is answered in a StepBatchReply, once every one is: its StepReply or
    its error. A hop that does not know this kind answers ProtocolError (UNKNOWN_KIND); the client then waits
    for each alone."""

    waits: tuple[StepWait, ...]


@dataclass(frozen=True)
class StepReply:
    """The hidden states after the last hop, and one timing per hop (this one first)."""

    hidden: torch.Tensor
    timings: tuple[HopTiming, ...] = ()
    codec: str = "exact"  # how ``hidden`` travels back (StepRequest.codec)


@dataclass(frozen=True)
class CloseRequest:
    """Close ``session_id`` here and on every hop of ``route_rest`` (freeing their KV cache)."""

    session_id: str
    route_rest: tuple[Hop, ...] = ()
    origin: str = ""  # as in StepRequest


@dataclass(frozen=True)
class CloseReply:
    closed: bool  # False when this peer did not know the session (already expired): not an error


@dataclass(frozen=True)
class HandoverRequest:
    """One chunk of a session's KV cache, sent by a leaving peer to its successor (see swarm.peer.handover).

    The session is ``session_id`` of client ``origin``, at ``position`` tokens, using layers [start, end).
    Chunks come in order: layer by layer, and within a layer by token span ``[token_start, token_start + n)``;
    ``keys``/``values`` are [kv_heads, n, head_dim]. The first chunk (start, 0) opens the session; the one that
    ends at (end - 1, position) completes it."""

    session_id: str
    origin: str
    position: int
    max_length_tokens: int
    start: int
    end: int
    model_hash: str
    layer: int
    token_start: int
    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class HandoverReply:
    installed: bool  # True once the last chunk is in: the session steps here from ``position`` on


@dataclass(frozen=True)
class MoveRequest:
    """The client asks this peer to hand its session ``session_id`` over to ``target_peer_id`` (at
    ``target_maddrs``), as a leaving peer would (HandoverRequest chunks), e.g. from the prefill route to a decode
    peer after the prompt. Only the session's own client may ask: the session is the caller's, and ``origin``,
    if set, must be the caller. The target must hold the session's layers; it refuses otherwise, or when its
    cache is full, and the session then stays here."""

    session_id: str
    target_peer_id: str
    target_maddrs: tuple[str, ...] = ()
    origin: str = ""


@dataclass(frozen=True)
class MoveReply:
    tokens: int  # the session's position, now held by the target: the client steps there from it
    kv_bytes: int  # the keys and values sent


@dataclass(frozen=True)
class InfoRequest:
    pass


@dataclass(frozen=True)
class CacheStats:
    """A peer's KV cache blocks now, and its prefix sharing since it started (InfoReply.cache)."""

    block_tokens: int
    used_blocks: int  # held by at least one session
    shared_blocks: int  # of them, held by more than one (a common prefix)
    free_blocks: int  # including prefixes nobody holds, kept for sharing until needed
    prefix_tokens_looked_up: int  # prompt tokens looked for among shared blocks
    prefix_tokens_shared: int  # of them, found

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_tokens_shared / self.prefix_tokens_looked_up if self.prefix_tokens_looked_up else 0.0
        )


@dataclass(frozen=True)
class InfoReply:
    """What a peer serves right now."""

    peer_id: str
    name: str
    model_name: str
    model_hash: str
    num_layers: int
    hidden_size: int
    dtype: str
    range_start: int
    range_end: int
    cache_tokens_total: int
    free_cache_tokens: int
    active_sessions: int
    state: str
    protocol_version: int = PROTOCOL_VERSION
    # The peer's background traffic so far: (cause, payload bytes sent, received), swarm.dht.traffic.CAUSES.
    background_bytes: tuple[tuple[str, int, int], ...] = ()
    cache: CacheStats | None = None  # None while it serves no range


@dataclass(frozen=True)
class ProbeRequest:
    """Link measurement. ``payload`` is echoed as a byte count only (upload bandwidth); ``reply_bytes`` asks for
    that many bytes back (download bandwidth). With ``dial_back_peer_id`` set, the receiver first tries to reach
    that peer at ``dial_back_maddrs`` with a tiny probe of its own and reports whether it could."""

    payload: bytes = b""
    reply_bytes: int = 0
    dial_back_peer_id: str = ""
    dial_back_maddrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeReply:
    peer_id: str
    received_bytes: int
    payload: bytes = b""
    dial_back_ok: bool | None = None  # None when no dial-back was asked
    dial_back_error: str = ""


@dataclass(frozen=True)
class ErrorReply:
    """A failure, with ``swarm.errors`` code so it is re-raised with its type; ``failed_peer_id`` names the peer
    that failed (this one, or a downstream hop that timed out or broke) so the client knows whom to ban."""

    code: str
    message: str
    failed_peer_id: str | None = None
    missing_layers: tuple[int, ...] = ()  # a NoRouteError's layers that no live peer serves
    successor_id: str | None = None  # a SessionMoved's new home

    def to_error(self) -> SwarmError:
        error = error_from_code(self.code, self.message, self.missing_layers, self.successor_id)
        error.failed_peer_id = self.failed_peer_id
        return error

    @classmethod
    def from_error(cls, error: BaseException, peer_id: str | None) -> ErrorReply:
        if isinstance(error, SwarmError):
            failed = error.failed_peer_id or peer_id
            missing = tuple(error.missing_layers[:MAX_LAYER]) if isinstance(error, NoRouteError) else ()
            successor = error.successor_id if isinstance(error, SessionMoved) else None
            return cls(error.code, str(error)[:MAX_TEXT_CHARS], failed, missing, successor)
        return cls(SwarmError.code, f"{type(error).__name__}: {error}"[:MAX_TEXT_CHARS], peer_id)


Request = (
    StepRequest
    | StepBatch
    | StepWait
    | StepWaits
    | CloseRequest
    | InfoRequest
    | ProbeRequest
    | HandoverRequest
    | MoveRequest
)
Reply = (
    StepReply
    | StepAck
    | StepBatchReply
    | CloseReply
    | InfoReply
    | ProbeReply
    | ErrorReply
    | HandoverReply
    | MoveReply
)

_REQUEST_KINDS: dict[type, str] = {
    StepRequest: "step",
    StepBatch: "steps",
    StepWait: "wait",
    StepWaits: "waits",
    CloseRequest: "close",
    InfoRequest: "info",
    ProbeRequest: "probe",
    HandoverRequest: "handover",
    MoveRequest: "move",
}
_REPLY_KINDS: dict[type, str] = {
    StepReply: "step_reply",
    StepAck: "step_ack",
    StepBatchReply: "steps_reply",
    CloseReply: "close_reply",
    InfoReply: "info_reply",
    ProbeReply: "probe_reply",
    ErrorReply: "error",
    HandoverReply: "handover_reply",
    MoveReply: "move_reply",
}
_REQUEST_KIND_NAMES = frozenset(_REQUEST_KINDS.values())
_REPLY_KIND_NAMES = frozenset(_REPLY_KINDS.values())
# The reply each request verb expects (besides ErrorReply).
REPLY_FOR: dict[type, type] = {
    StepRequest: StepReply,  # StepAck when it has wait_result
    StepBatch: StepBatchReply,
    StepWait: StepReply,
    StepWaits: StepBatchReply,
    CloseRequest: CloseReply,
    InfoRequest: InfoReply,
    ProbeRequest: ProbeReply,
    HandoverRequest: HandoverReply,
    MoveRequest: MoveReply,
}


def request_verb(request: Request) -> str:
    """ "step", "steps", "wait", "waits", "close", "info", "probe", "handover" or "move": the rpc_<verb> that
    handles it."""
    return _REQUEST_KINDS[type(request)]


# ---------------------------------------------------------------- tensors


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """(dtype, shape, raw bytes); the tensor is moved to CPU and made contiguous, its dtype is kept.

    ``data`` is a view of the tensor's memory (no copy; msgpack copies it once, into the message), so the
    tensor must not change before the message is packed.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ProtocolError(f"cannot send a {tensor.dtype} tensor: wire dtypes are {sorted(WIRE_DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().data
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def decode_tensor(obj: object, what: str = "tensor") -> torch.Tensor:
    body = _map(obj, what)
    name = _str(body, "dtype", what)
    dtype = WIRE_DTYPES.get(name)
    if dtype is None:
        raise ProtocolError(f"{what}: unsupported dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
    shape = body.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
        raise ProtocolError(f"{what}: shape must be a list of 1 to 4 dimensions, got {shape!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_TOKENS * 16 for d in shape):
        raise ProtocolError(f"{what}: every dimension must be a positive int, got shape {shape}")
    data = body.get("data")
    if not isinstance(data, bytes | memoryview):  # memoryview: an encode_tensor result decoded unsent
        raise ProtocolError(f"{what}: data must be bytes")
    expected = math.prod(shape) * DTYPE_BYTES[name]
    if expected > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{what}: {expected} bytes is over the {MAX_TENSOR_BYTES}-byte tensor limit")
    if len(data) != expected:
        raise ProtocolError(f"{what}: shape {shape} of {name} needs {expected} bytes, got {len(data)}")
    # One copy, on purpose: msgpack hands us immutable bytes, and the tensor must own writable memory (torch
    # warns on, and in-place ops would write into, a view of bytes).
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    return flat.reshape(shape)


def encode_hidden(hidden: torch.Tensor, codec: str = "exact") -> dict[str, Any]:
    """Hidden states [T, H] in ``codec`` (swarm.codec): exact as encode_tensor; f16 as a 16-bit tensor with
    ``codec``; q8 as int8 ``data`` [T, H] with, per block of Q8_BLOCK values, float32 ``scales`` and
    ``peaks`` and uint8 ``peak_index`` [T, ceil(H / Q8_BLOCK)], and the ``dtype`` to decode them to. Without
    a ``codec`` key a tensor is exact, so exact states keep their old bytes."""
    if codec == "exact":
        return encode_tensor(hidden)
    if codec == "f16":
        return encode_tensor(to_f16(hidden)) | {"codec": "f16"}
    if codec != "q8":
        raise ValueError(f"unknown activation codec {codec!r}; expected one of {CODECS}")
    if hidden.dim() != 2:
        raise ProtocolError(f"q8 sends hidden states [tokens, hidden_size], got shape {list(hidden.shape)}")
    name = _DTYPE_NAMES.get(hidden.dtype)
    if name is None:
        raise ProtocolError(f"cannot send a {hidden.dtype} tensor: wire dtypes are {sorted(WIRE_DTYPES)}")
    return {"codec": "q8", "dtype": name, "shape": list(hidden.shape)} | pack_q8(hidden)


def decode_hidden(obj: object, what: str = "hidden") -> tuple[torch.Tensor, str]:
    """(hidden states, the codec they came in), from encode_hidden's map; ProtocolError for anything else."""
    body = _map(obj, what)
    codec = body.get("codec", "exact")
    if codec == "q8":
        return _decode_q8(body, what), codec
    if "codec" in body and codec != "f16":
        raise ProtocolError(f"{what}: unknown codec {codec!r}; expected one of {CODECS[1:]} or none")
    hidden = decode_tensor(body, what)
    if codec == "f16" and hidden.dtype not in (torch.float16, torch.bfloat16):
        raise ProtocolError(f"{what}: f16 states must be float16 or bfloat16, got {hidden.dtype}")
    return hidden, codec


def _decode_q8(body: dict[str, Any], what: str) -> torch.Tensor:
    name = _str(body, "dtype", what)
    dtype = WIRE_DTYPES.get(name)
    if dtype is None:
        raise ProtocolError(f"{what}: unsupported dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
    shape = body.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int for d in shape)):
        raise ProtocolError(f"{what}: q8 shape must be [tokens, hidden_size], got {shape!r}")
    tokens, size = shape
    if not (0 < tokens <= MAX_TOKENS and 0 < size <= MAX_HIDDEN_SIZE):
        raise ProtocolError(f"{what}: q8 shape {shape} is past the limits [{MAX_TOKENS}, {MAX_HIDDEN_SIZE}]")
    if tokens * bytes_per_token("q8", dtype, size) > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{what}: q8 shape {shape} is over the {MAX_TENSOR_BYTES}-byte tensor limit")
    if tokens * size * 4 > MAX_TENSOR_BYTES:  # decoding works in float32: bound what it unpacks to as well
        raise ProtocolError(f"{what}: q8 shape {shape} unpacks past the {MAX_TENSOR_BYTES}-byte tensor limit")
    return dequantize_q8(unpack_q8(body, tokens, size, what), dtype)


def _hidden(body: dict[str, Any]) -> tuple[torch.Tensor, str]:
    hidden, codec = decode_hidden(body.get("hidden"), "hidden")
    if hidden.dim() != 2:
        raise ProtocolError(f"hidden must be [tokens, hidden_size], got shape {list(hidden.shape)}")
    tokens, size = hidden.shape
    if tokens > MAX_TOKENS or size > MAX_HIDDEN_SIZE:
        raise ProtocolError(
            f"hidden shape {list(hidden.shape)} is past the limits [{MAX_TOKENS}, {MAX_HIDDEN_SIZE}]"
        )
    if not _all_finite(hidden):
        raise ProtocolError("hidden contains NaN or infinity")
    return hidden, codec


def _codec(body: dict[str, Any], what: str) -> str:
    codec = body.get("codec", "exact")
    if codec not in CODECS:
        raise ProtocolError(f"{what}.codec must be one of {CODECS}, got {codec!r}")
    return str(codec)


def _all_finite(tensor: torch.Tensor) -> bool:
    # numpy's isfinite on a CPU view costs a fraction of torch's op dispatch for the small tensors of decode
    # steps; bfloat16, which numpy lacks, goes by amax/amin (they propagate NaN and see infinities).
    if tensor.dtype in (torch.float32, torch.float16):
        return bool(np.isfinite(tensor.numpy()).all())
    return bool(torch.isfinite(tensor.amax()) and torch.isfinite(tensor.amin()))


# ---------------------------------------------------------------- field checks


def _map(obj: object, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ProtocolError(f"{what} must be a map with string keys, got {type(obj).__name__}")
    return obj


def _int(body: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{what}.{key} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(f"{what}.{key} = {value} is out of range [{lo}, {hi}]")
    return value


def _float(body: dict[str, Any], key: str, what: str) -> float:
    value = body.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ProtocolError(f"{what}.{key} must be a finite non-negative number, got {value!r}")
    return float(value)


def _timeout(body: dict[str, Any], what: str) -> float:
    if "timeout_s" not in body:  # sent by a peer of an earlier release of this protocol version
        return DEFAULT_STEP_TIMEOUT_S
    value = _float(body, "timeout_s", what)
    if not 0 < value <= MAX_STEP_TIMEOUT_S:
        raise ProtocolError(f"{what}.timeout_s must be in (0, {MAX_STEP_TIMEOUT_S:.0f}] seconds, got {value}")
    return value


def _flag(body: dict[str, Any], key: str, what: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(f"{what}.{key} must be a bool, got {type(value).__name__}")
    return value


def _str(body: dict[str, Any], key: str, what: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{what}.{key} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ProtocolError(f"{what}.{key} is {len(value)} characters, over the {max_chars} limit")
    return value


def _cache_stats(body: dict[str, Any], what: str) -> CacheStats | None:
    """InfoReply.cache: absent, or [block_tokens, used, shared, free, prefix looked up, prefix shared]."""
    items = body.get("cache")
    if items is None:
        return None
    names = list(CacheStats.__dataclass_fields__)
    if not isinstance(items, list) or len(items) != len(names):
        raise ProtocolError(f"{what}.cache must be a list of {len(names)} ints")
    return CacheStats(
        **{name: _int({name: item}, name, what) for name, item in zip(names, items, strict=True)}
    )


def _background_bytes(body: dict[str, Any], what: str) -> tuple[tuple[str, int, int], ...]:
    """InfoReply.background_bytes: at most MAX_TRAFFIC_CAUSES [cause, sent, received] triples."""
    items = body.get("background_bytes", [])
    if not isinstance(items, list) or len(items) > MAX_TRAFFIC_CAUSES:
        raise ProtocolError(f"{what}.background_bytes must be a list of at most {MAX_TRAFFIC_CAUSES} items")
    triples = []
    for item in items:
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError(f"{what}.background_bytes items must be [cause, sent, received]")
        cause = _str({"cause": item[0]}, "cause", what, 32)
        sent = _int({"sent": item[1]}, "sent", what)
        received = _int({"received": item[2]}, "received", what)
        triples.append((cause, sent, received))
    return tuple(triples)


def _origin(body: dict[str, Any], what: str) -> str:
    return _str(body, "origin", what, 128) if "origin" in body else ""


def _layers(body: dict[str, Any], what: str) -> tuple[int, int]:
    start = _int(body, "start", what, 0, MAX_LAYER)
    end = _int(body, "end", what, 1, MAX_LAYER)
    if end <= start:
        raise ProtocolError(f"{what}: empty layer range [{start}, {end})")
    return start, end


def _maddrs(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_MADDRS:
        raise ProtocolError(f"{what}.maddrs must be a list of at most {MAX_MADDRS} strings")
    if not all(isinstance(m, str) and len(m) <= 512 for m in value):
        raise ProtocolError(f"{what}.maddrs must hold multiaddr strings")
    return tuple(value)


def _route(body: dict[str, Any]) -> tuple[Hop, ...]:
    value = body.get("route_rest", [])
    if not isinstance(value, list) or len(value) > MAX_ROUTE_HOPS:
        raise ProtocolError(f"route_rest must be a list of at most {MAX_ROUTE_HOPS} hops")
    hops = []
    for i, item in enumerate(value):
        hop = _map(item, f"route_rest[{i}]")
        start, end = _layers(hop, f"route_rest[{i}]")
        hops.append(Hop(_str(hop, "peer_id", "hop", 128), _maddrs(hop.get("maddrs"), "hop"), start, end))
    return tuple(hops)


def _encode_route(route: tuple[Hop, ...]) -> list[dict[str, Any]]:
    return [{"peer_id": h.peer_id, "maddrs": list(h.maddrs), "start": h.start, "end": h.end} for h in route]


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
    return MoveRequest(_str(body, "session_id", w, 128), target, maddrs, _origin(body, w))


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
    "ErrorReply",
    "Hop",
    "HopTiming",
    "HandoverReply",
    "HandoverRequest",
    "InfoReply",
    "InfoRequest",
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
    "decode_reply",
    "decode_request",
    "decode_hidden",
    "decode_tensor",
    "encode_reply",
    "encode_request",
    "encode_hidden",
    "encode_tensor",
    "request_verb",
]
