"""Per-session KV caches for a range of layers, under a budget of cache tokens.

Layout: each session owns, for every layer it holds, one keys and one values tensor shaped
[kv_heads, capacity, head_dim]. Capacity grows by doubling up to the session's max_length_tokens, so a session
that asked for 8k tokens but used 50 holds memory for 64. The BUDGET however is reserved up front: opening a
session reserves max_length_tokens slots from `cache_tokens`, so a session never fails half-way for lack of room.
Each layer keeps its own length because routes may run a session through only part of a block's layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.types import LayerRange

logger = logging.getLogger(__name__)

_MIN_CAPACITY_TOKENS = 64


@dataclass
class SessionCache:
    """Keys and values of one session for layers [layers.start, layers.end)."""

    session_id: str
    max_length_tokens: int
    layers: LayerRange
    keys: list[torch.Tensor | None] = field(
        default_factory=list
    )  # per held layer: [kv_heads, capacity, head_dim]
    values: list[torch.Tensor | None] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # tokens cached per held layer

    def __post_init__(self) -> None:
        n = len(self.layers)
        self.keys, self.values, self.lengths = [None] * n, [None] * n, [0] * n

    def length(self, layer: int) -> int:
        return self.lengths[layer - self.layers.start]

    def truncate(self, layer: int, length: int) -> None:
        """Forget tokens at positions >= length in `layer` (replay after a retry or failover)."""
        i = layer - self.layers.start
        self.lengths[i] = min(self.lengths[i], length)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [kv_heads, T, head_dim] after the cached tokens; return views of all [kv_heads, L, head_dim]."""
        keys, values, old = self.reserve(layer, k)
        new = old + k.shape[1]
        keys[:, old:new] = k
        values[:, old:new] = v
        return keys[:, :new], values[:, :new]

    def reserve(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Count ``like.shape[1]`` more tokens in ``layer``, whose keys and values the caller writes at once:
        (keys, values, old length), the whole stores [kv_heads, capacity, head_dim] with room for them."""
        i = layer - self.layers.start
        old, new = self.lengths[i], self.lengths[i] + like.shape[1]
        if new > self.max_length_tokens:
            raise ProtocolError(
                f"session {self.session_id}: {new} tokens exceed its max length {self.max_length_tokens}"
            )
        keys, values = self.keys[i], self.values[i]
        if keys is None or values is None or keys.shape[1] < new:
            keys, values = self._grow(i, like, new)
        self.lengths[i] = new
        return keys, values, old

    def widen(self, layers: LayerRange) -> None:
        """Hold ``layers`` (which cover the held ones) from now on; the new layers start empty. The cached
        tensors are kept, not copied: a peer whose new range contains its old one carries its sessions over."""
        if not layers.covers(self.layers):
            raise ValueError(f"session {self.session_id}: {layers} does not cover its layers {self.layers}")
        before, after = self.layers.start - layers.start, layers.end - self.layers.end
        self.keys = [None] * before + self.keys + [None] * after
        self.values = [None] * before + self.values + [None] * after
        self.lengths = [0] * before + self.lengths + [0] * after
        self.layers = layers

    def _grow(self, i: int, like: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        old_keys, old_values = self.keys[i], self.values[i]
        capacity = _MIN_CAPACITY_TOKENS if old_keys is None else old_keys.shape[1]
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_length_tokens)
        shape = (like.shape[0], capacity, like.shape[2])
        keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        values = torch.empty(shape, dtype=like.dtype, device=like.device)
        if old_keys is not None and old_values is not None:
            keep = self.lengths[i]
            keys[:, :keep] = old_keys[:, :keep]
            values[:, :keep] = old_values[:, :keep]
        self.keys[i], self.values[i] = keys, values
        return keys, values


class KVCache:
    """The sessions of one BlockRange and the cache-token budget they share."""

    def __init__(self, layers: LayerRange, cache_tokens: int) -> None:
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        self.layers = layers
        self.cache_tokens = cache_tokens
        self._sessions: dict[str, SessionCache] = {}
        self._reserved_tokens = 0

    @property
    def free_tokens(self) -> int:
        return self.cache_tokens - self._reserved_tokens

    @property
    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def open(self, session_id: str, max_length_tokens: int) -> SessionCache:
        if not isinstance(session_id, str) or not session_id:
            raise ProtocolError(f"session id must be a non-empty string, got {session_id!r}")
        if max_length_tokens <= 0:
            raise ProtocolError(f"max_length_tokens must be positive, got {max_length_tokens}")
        if session_id in self._sessions:
            raise SessionError(f"session {session_id} is already open")
        if max_length_tokens > self.free_tokens:
            raise CapacityError(
                f"KV cache full: session {session_id} asks for {max_length_tokens} tokens, "
                f"{self.free_tokens} of {self.cache_tokens} are free"
            )
        session = SessionCache(session_id, max_length_tokens, self.layers)
        self._sessions[session_id] = session
        self._reserved_tokens += max_length_tokens
        logger.debug(
            "opened session %s (%d tokens, %d free)", session_id, max_length_tokens, self.free_tokens
        )
        return session

    def adopt(self, session: SessionCache) -> None:
        """Take ``session`` (open in the cache of a range this one contains) as it is: same id, same tensors,
        widened to our layers, its reservation counted against our budget."""
        if session.session_id in self._sessions:
            raise SessionError(f"session {session.session_id} is already open")
        if session.max_length_tokens > self.free_tokens:
            raise CapacityError(
                f"KV cache full: cannot carry session {session.session_id} over "
                f"({session.max_length_tokens} tokens, {self.free_tokens} free)"
            )
        session.widen(self.layers)
        self._sessions[session.session_id] = session
        self._reserved_tokens += session.max_length_tokens

    def close(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise SessionError(f"unknown session {session_id}")
        self._reserved_tokens -= session.max_length_tokens

    def get(self, session_id: str) -> SessionCache:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(f"unknown session {session_id}: open it first (or it expired)")
        return session
