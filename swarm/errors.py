"""The FlowSwarm exception tree. Each error has a stable wire code so it keeps its type across peers.

SwarmError
├── TransportError        the peer did not answer in time or the connection broke: retry elsewhere
├── ProtocolError         the peer sent or was sent something malformed: ban the peer (or fix the caller)
│   └── VersionMismatch   protocol versions differ: fail fast
├── CapacityError         the peer is full (KV cache, sessions): route elsewhere
├── SessionError          unknown or expired session on the peer: reopen and replay
│   └── SessionMoved      the peer handed the session's cache to ``successor_id``: follow it, no replay
├── NoRouteError          no live peer serves some layers: tell the user which
├── PlanningError         the solver failed or timed out: fall back to a heuristic
└── ModelMismatch         the peer holds a different model (weight hash differs)
"""

from __future__ import annotations

from collections.abc import Sequence


class SwarmError(Exception):
    code = "swarm_error"
    # Set on errors that came back over the wire: the peer that failed (to ban), when the remote side knew it.
    failed_peer_id: str | None = None


class TransportError(SwarmError):
    code = "transport"


class ProtocolError(SwarmError):
    code = "protocol"


class VersionMismatch(ProtocolError):
    code = "version_mismatch"


class CapacityError(SwarmError):
    code = "capacity"


class SessionError(SwarmError):
    code = "session"


class SessionMoved(SessionError):
    """The session's KV cache now lives on ``successor_id`` (a peer holding the same layers): step there at the
    same position. A subclass of SessionError, so a client that does not know it replays, which is still right."""

    code = "session_moved"

    def __init__(self, message: str, successor_id: str | None = None) -> None:
        super().__init__(message)
        self.successor_id = successor_id


class SessionEvicted(SessionError):
    """The peer's cache was short and this session, idle longest for the tokens it held, lost its blocks. A
    subclass of SessionError: the client replays it, as after any lost session."""

    code = "session_evicted"


class NoRouteError(SwarmError):
    code = "no_route"

    def __init__(self, missing_layers: list[int], message: str | None = None) -> None:
        self.missing_layers = missing_layers
        super().__init__(message or f"no live peer serves layers {_ranges_text(missing_layers)}")


class PlanningError(SwarmError):
    code = "planning"


class ModelMismatch(SwarmError):
    code = "model_mismatch"


_BY_CODE: dict[str, type[SwarmError]] = {
    cls.code: cls
    for cls in (
        SwarmError,
        TransportError,
        ProtocolError,
        VersionMismatch,
        CapacityError,
        SessionError,
        SessionMoved,
        SessionEvicted,
        PlanningError,
        ModelMismatch,
    )
}


def error_from_code(
    code: str, message: str, missing_layers: Sequence[int] = (), successor_id: str | None = None
) -> SwarmError:
    """Rebuild a remote error with its original type (unknown codes become plain SwarmError).

    `missing_layers` is the payload of a NoRouteError, so the user still learns which layers are missing.
    """
    if code == NoRouteError.code:
        return NoRouteError(list(missing_layers), message)
    if code == SessionMoved.code:
        return SessionMoved(message, successor_id)
    return _BY_CODE.get(code, SwarmError)(message)


def _ranges_text(layers: list[int]) -> str:
    """[3, 4, 5, 9] -> "3:6, 9:10" (half-open ranges)."""
    parts: list[str] = []
    for layer in sorted(layers):
        if parts and int(parts[-1].split(":")[1]) == layer:
            start = parts[-1].split(":")[0]
            parts[-1] = f"{start}:{layer + 1}"
        else:
            parts.append(f"{layer}:{layer + 1}")
    return ", ".join(parts)
