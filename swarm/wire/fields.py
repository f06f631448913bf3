"""Checks of a message body's fields: each wrong field is a ProtocolError that names it."""

from __future__ import annotations

import math
from typing import Any

from swarm.errors import (
    ProtocolError,
)
from swarm.wire.limits import (
    DEFAULT_STEP_TIMEOUT_S,
    MAX_LAYER,
    MAX_MADDRS,
    MAX_ROUTE_HOPS,
    MAX_STEP_TIMEOUT_S,
    MAX_TEXT_CHARS,
    MAX_TRAFFIC_CAUSES,
)
from swarm.wire.messages import (
    CacheStats,
    Hop,
)


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
