"""The messages: each request, its reply, and which kind name each goes by on the wire (swarm.wire)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import (
    NoRouteError,
    SessionMoved,
    SwarmError,
    error_from_code,
)
from swarm.wire.limits import (
    DEFAULT_STEP_TIMEOUT_S,
    MAX_LAYER,
    MAX_TEXT_CHARS,
)


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
    cache is full, and the session then stays here.

    With ``layers`` (start, end), only those of the session's layers move, and the session stays here too (a
    stage split between decode peers: one part to each, the client closes it here once all are in)."""

    session_id: str
    target_peer_id: str
    target_maddrs: tuple[str, ...] = ()
    origin: str = ""
    layers: tuple[int, int] | None = None


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
