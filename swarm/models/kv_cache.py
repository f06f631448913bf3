"""Per-session KV caches for a range of layers, in fixed-size blocks of one pool (paged attention's layout).

Layout: the range's cache is a pool of ``cache_tokens // block_tokens`` blocks. Each layer stores them as one
keys and one values tensor [kv_heads, blocks, block_tokens, head_dim] (made on the layer's first use); block b
of a session holds its tokens [b * block_tokens, (b + 1) * block_tokens) in every layer of the range. A session
has a block table (the pool's block ids in order, the same for all its layers) and one length per layer (routes
may run a session through only part of a range's layers). Attention reads through the table: the torch path
gathers a session's blocks, the CPU kernel follows the table itself.

Memory is taken as tokens arrive, never reserved: ``max_length_tokens`` is a promise the peer may decline later.
When a step needs blocks and the pool is short, the cache takes them back from the sessions that have gone
longest without a step relative to the tokens they hold (idle seconds per held token, highest first; never a
session of the step's own batch). A session decoding holds many tokens and steps every few tens of ms, so a
session of a few tokens kept alive by a step now and then goes long before it. Such a session keeps its place,
empty, and its next step gets ``SessionEvicted`` (its client replays it, which may open it here again at
position 0). Announcements count as free the blocks of sessions idle for ``min_idle_s`` or more.

With prefix sharing on, full blocks are offered to later sessions whose inputs match from position 0 (chained
hashes), copy-on-write; a block nobody holds any more stays offered, as free memory taken last, until the pool
needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import NamedTuple

import torch

from swarm.errors import CapacityError, ProtocolError, SessionError, SessionEvicted
from swarm.types import LayerRange

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # tokens per block: a multiple of 8, which the CPU kernel's attention reads at a time
MIN_IDLE_S = 1.0  # a session idle this long counts its blocks as free to newcomers (available_tokens)


class Slot(NamedTuple):
    """Where a step's token goes in one layer, as the CPU kernel takes it (a tuple: made per layer and step)."""

    keys: torch.Tensor  # the layer's pool [kv_heads, blocks, block_tokens, head_dim]
    values: torch.Tensor
    table: torch.Tensor  # int64 [n]: the session's blocks in order
    length: int  # tokens cached before this one


class BlockPool:
    """The blocks of one range: which are free, and each layer's storage of them."""

    def __init__(self, layers: LayerRange, blocks: int, block_tokens: int) -> None:
        self.layers = layers
        self.blocks = blocks
        self.block_tokens = block_tokens
        self._free = list(range(blocks - 1, -1, -1))  # a stack: low ids first
        self.refs = [0] * blocks  # sessions holding each block (more than one: a shared prefix block)
        # full prefix blocks others may share: hash of their inputs (chained from position 0) -> block, and back;
        # each with the range's outputs for its rows, which a session sharing it sends on without computing them
        self.index: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # indexed blocks nobody holds, least recently let go first: free, but taken only after the plain free
        # ones, so a prompt seen a while ago (a chat's system prompt, a closed chat's turns) is still shared
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.keys: list[torch.Tensor | None] = [None] * len(layers)  # per layer [kv, blocks, B, hd]
        self.values: list[torch.Tensor | None] = [None] * len(layers)

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self.cached)

    @property
    def shared_blocks(self) -> int:
        """Blocks more than one session holds (a common prefix)."""
        return sum(r > 1 for r in self.refs)

    def take(self, count: int) -> list[int]:
        if count > self.free_blocks:
            raise CapacityError(f"KV cache full: {count} blocks wanted, {self.free_blocks} free")
        while len(self._free) < count:  # the plain free blocks first, then the oldest cached prefixes
            oldest = next(iter(self.cached))
            self.unindex(oldest)
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        for block in taken:
            self.refs[block] = 1
        return taken[::-1]

    def hold(self, block: int) -> None:
        """One more holder of an indexed block (sharing it)."""
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def give(self, ids: Collection[int]) -> None:
        """Drop one holder of each block; a block nobody holds is free again (kept for sharing if indexed)."""
        for block in ids:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.cached[block] = None
                else:
                    self._free.append(block)

    def unindex(self, block: int) -> None:
        """Stop offering ``block`` for sharing (it is about to be written, or taken for another use)."""
        key = self.hash_of.pop(block, None)
        if key is None:
            return
        del self.index[key]
        del self.outputs[block]
        if block in self.cached:
            del self.cached[block]
            self._free.append(block)

    def copy(self, source: int, target: int) -> None:
        """Block ``source``'s keys and values into block ``target``, in every layer stored."""
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is not None and values is not None:
                keys[:, target], values[:, target] = keys[:, source], values[:, source]

    def storage(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values [kv_heads, blocks, block_tokens, head_dim], made on first use in
        ``like``'s kv heads, head size, dtype and device (like: [kv_heads, T, head_dim])."""
        i = layer - self.layers.start
        keys, values = self.keys[i], self.values[i]
        if keys is None or values is None:
            shape = (like.shape[0], self.blocks, self.block_tokens, like.shape[2])
            keys = self.keys[i] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            values = self.values[i] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return keys, values

    def stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        i = layer - self.layers.start
        keys, values = self.keys[i], self.values[i]
        return None if keys is None or values is None else (keys, values)


class SessionCache:
    """Keys and values of one session for layers [layers.start, layers.end): its block table and lengths."""

    def __init__(self, session_id: str, max_length_tokens: int, home: KVCache) -> None:
        self.session_id = session_id
        self.max_length_tokens = max_length_tokens
        self.home = home
        self.layers = home.layers
        self.lengths = [0] * len(self.layers)  # tokens cached per held layer
        self.blocks: list[int] = []  # pool block ids, in order
        self._set_blocks([])  # and self.table, the same ids as a tensor (what kernels read)
        self.chain: list[bytes] = []  # prefix hashes of its first full blocks (see KVCache.attach_prefix)
        self.last_step_s = home.clock()
        self.evicted = False  # its blocks were taken back: its next step (past position 0) is told so

    @property
    def block_tokens(self) -> int:
        return self.home.pool.block_tokens

    @property
    def held_tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    def length(self, layer: int) -> int:
        return self.lengths[layer - self.layers.start]

    def cut(self, lengths: Mapping[int, int]) -> None:
        """Forget tokens at positions >= ``lengths[layer]`` in each of these layers at once (a step's replay
        after a retry or failover, or a failed call's rows). Blocks no layer uses any more go back to the pool;
        the blocks from the shortest layer's end on, which steps write again, become our own (``_own``)."""
        with self.home.lock:
            for layer, length in lengths.items():
                i = layer - self.layers.start
                self.lengths[i] = min(self.lengths[i], length)
            keep = math.ceil(max(self.lengths, default=0) / self.block_tokens)
            if keep < len(self.blocks):  # also blocks a failed call took and never wrote
                self.home.pool.give(self.blocks[keep:])
                self._set_blocks(self.blocks[:keep])
            first = (
                min(self.lengths, default=0) // self.block_tokens
            )  # blocks from here on may be written again
            del self.chain[first:]
            self._own(first)

    def _own(self, first: int) -> None:
        """Copy-on-write: blocks from index ``first`` on that other sessions share become copies of our own;
        those only we hold stop being offered for sharing (what others would find there is about to change).
        All copies are had first (evicting idle sessions if need be): a CapacityError changes nothing."""
        pool = self.home.pool
        for block in self.blocks[first:]:
            if pool.refs[block] == 1:
                pool.unindex(block)
        shared = [i for i in range(first, len(self.blocks)) if pool.refs[self.blocks[i]] > 1]
        if not shared:
            return
        self.home.make_room(len(shared), {self.session_id})
        copies = pool.take(len(shared))
        blocks = list(self.blocks)
        for i, copy in zip(shared, copies, strict=True):
            pool.copy(blocks[i], copy)
        pool.give([blocks[i] for i in shared])
        for i, copy in zip(shared, copies, strict=True):
            blocks[i] = copy
        self._set_blocks(blocks)

    def grow(self, tokens: int, protect: Collection[str] = ()) -> None:
        """Hold blocks for ``tokens`` tokens (evicting idle sessions other than ``protect`` if need be)."""
        if tokens > self.max_length_tokens:
            raise ProtocolError(
                f"session {self.session_id}: {tokens} tokens exceed its max length {self.max_length_tokens}"
            )
        if tokens <= len(self.blocks) * self.home.pool.block_tokens:  # room already: the common case
            return
        with self.home.lock:
            more = math.ceil(tokens / self.block_tokens) - len(self.blocks)
            if more > 0:
                self.home.make_room(more, {*protect, self.session_id})
                self._set_blocks(self.blocks + self.home.pool.take(more))

    def _set_blocks(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.table = torch.tensor(blocks, dtype=torch.int64)
        self._tables: dict[torch.device, torch.Tensor] = {}  # the table on the pool's device, copied once

    def table_on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.table
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = self.table.to(device)
        return table

    def release(self) -> None:
        """Give every block back (closed or evicted)."""
        with self.home.lock:
            self.home.pool.give(self.blocks)
            self._set_blocks([])
            self.lengths = [0] * len(self.layers)
            self.chain = []

    def slot(self, layer: int, like: torch.Tensor) -> Slot:
        """Count ``like.shape[1]`` more tokens in ``layer``, whose keys and values the caller writes at once
        (the CPU kernel): the layer's pool, the table and the old length."""
        i = layer - self.layers.start
        old = self.lengths[i]
        self.grow(old + like.shape[1])
        keys, values = self.home.pool.storage(layer, like)
        self.lengths[i] = old + like.shape[1]
        return Slot(keys, values, self.table, old)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [kv_heads, T, head_dim] after the cached tokens; return all [kv_heads, L, head_dim]."""
        i = layer - self.layers.start
        old, new = self.lengths[i], self.lengths[i] + k.shape[1]
        self.grow(new)
        keys, values = self.home.pool.storage(layer, k)
        at = torch.arange(old, new, device=keys.device)
        table = self.table_on(keys.device)
        blocks, offsets = table[at // self.block_tokens], at % self.block_tokens
        keys[:, blocks, offsets] = k  # [kv_heads, T, head_dim] into their rows
        values[:, blocks, offsets] = v
        self.lengths[i] = new
        return self.gather(layer, new)

    def gather(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of ``layer`` as contiguous keys and values [kv_heads, length, head_dim]."""
        stored = self.home.pool.stored(layer)
        if stored is None or length > self.length(layer):
            raise ValueError(f"session {self.session_id}: layer {layer} holds {self.length(layer)} tokens")
        keys, values = stored
        used = self.table_on(keys.device)[: math.ceil(length / self.block_tokens)]
        return _contiguous(keys, used, length), _contiguous(values, used, length)

    def rehome(self, home: KVCache) -> None:
        """Move into ``home`` (a range containing ours): blocks copied into its pool, the new layers empty. The
        object stays the same, so whoever still holds it (a step queued on the old range) reads the new pool."""
        if not home.layers.covers(self.layers):
            raise ValueError(
                f"session {self.session_id}: {home.layers} does not cover its layers {self.layers}"
            )
        with self.home.lock, home.lock:
            self._rehome(home)

    def _rehome(self, home: KVCache) -> None:
        old_pool, old_blocks = self.home.pool, self.blocks
        new_blocks = home.pool.take(len(old_blocks))
        for layer in range(self.layers.start, self.layers.end):
            stored = old_pool.stored(layer)
            if stored is not None and old_blocks:
                ids = torch.tensor(old_blocks, device=stored[0].device)
                target = torch.tensor(new_blocks, device=stored[0].device)
                keys, values = home.pool.storage(layer, stored[0][:, 0])
                keys[:, target], values[:, target] = stored[0][:, ids], stored[1][:, ids]
        old_pool.give(old_blocks)
        before, after = self.layers.start - home.layers.start, home.layers.end - self.layers.end
        self.lengths = [0] * before + self.lengths + [0] * after
        self.layers, self.home = home.layers, home
        self._set_blocks(new_blocks)
        self.chain = []  # our own copies: shared with nobody in the new pool


def _contiguous(pool: torch.Tensor, used: torch.Tensor, length: int) -> torch.Tensor:
    # pool [kv_heads, blocks, B, head_dim] -> its blocks `used` [kv_heads, n, B, head_dim] -> [kv_heads, n * B,
    # head_dim], cut to length
    kv_heads, _, block_tokens, head_dim = pool.shape
    return pool.index_select(1, used).view(kv_heads, -1, head_dim)[:, :length]


class KVCache:
    """The sessions of one BlockRange and the pool of blocks they share."""

    def __init__(
        self,
        layers: LayerRange,
        cache_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        if block_tokens <= 0 or block_tokens % 8:
            raise ValueError(f"block_tokens must be a positive multiple of 8, got {block_tokens}")
        self.layers = layers
        self.pool = BlockPool(layers, cache_tokens // block_tokens, block_tokens)
        self.cache_tokens = self.pool.blocks * block_tokens
        self.clock = clock
        self.min_idle_s = MIN_IDLE_S
        self._sessions: dict[str, SessionCache] = {}
        self.evictions = 0  # sessions whose blocks were taken back, since the start
        self.share_prefixes = False  # full blocks of identical prompts shared (attach_prefix); off by default
        self.prefix_tokens_looked_up = 0  # prompt tokens whose blocks were looked for, since the start
        self.prefix_tokens_shared = 0  # of them, found and shared
        # The decode and prefill lanes' threads both step sessions of this cache (swarm.peer.executor): every
        # change to the pool, the tables and the index is made under this lock, and a session with a forward
        # call in flight (``stepping``) is never evicted, whichever thread wants its blocks.
        self.lock = threading.RLock()
        self.busy: Counter[str] = Counter()

    @contextlib.contextmanager
    def stepping(self, session_ids: Collection[str]) -> Iterator[None]:
        """Around a forward call of these sessions: none of them is evicted until it ends."""
        with self.lock:
            self.busy.update(session_ids)
        try:
            yield
        finally:
            with self.lock:
                self.busy.subtract(session_ids)
                self.busy += Counter()  # drop the zeros

    def use_clock(self, clock: Callable[[], float], min_idle_s: float) -> None:
        """Time sessions' steps by ``clock`` (the peer's); sessions idle ``min_idle_s`` count as free."""
        now = clock()
        for session in self._sessions.values():
            session.last_step_s = now
        self.clock, self.min_idle_s = clock, min_idle_s

    @property
    def free_tokens(self) -> int:
        return self.pool.free_blocks * self.pool.block_tokens

    @property
    def used_tokens(self) -> int:
        return self.cache_tokens - self.free_tokens

    @property
    def available_tokens(self) -> int:
        """Free tokens and those of sessions that could be evicted now: what a new session can get."""
        now = self.clock()
        sessions = list(self._sessions.values())  # one copy: read from the event loop too
        refs = self.pool.refs
        idle = sum(  # a block another session shares stays held when an idle one is evicted
            sum(refs[b] == 1 for b in s.blocks)
            for s in sessions
            if now - s.last_step_s >= self.min_idle_s and s.session_id not in self.busy
        )
        return self.free_tokens + idle * self.pool.block_tokens

    @property
    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def open(self, session_id: str, max_length_tokens: int) -> SessionCache:
        """Open a session holding nothing yet; ``max_length_tokens`` only bounds it (it must fit the pool)."""
        if not isinstance(session_id, str) or not session_id:
            raise ProtocolError(f"session id must be a non-empty string, got {session_id!r}")
        if max_length_tokens <= 0:
            raise ProtocolError(f"max_length_tokens must be positive, got {max_length_tokens}")
        if session_id in self._sessions:
            raise SessionError(f"session {session_id} is already open")
        if max_length_tokens > self.cache_tokens:
            raise CapacityError(
                f"KV cache full: session {session_id} asks for {max_length_tokens} tokens, "
                f"this cache holds {self.cache_tokens}"
            )
        session = SessionCache(session_id, max_length_tokens, self)
        with self.lock:
            self._sessions[session_id] = session
        logger.debug("opened session %s (up to %d tokens)", session_id, max_length_tokens)
        return session

    def adopt(self, session: SessionCache) -> None:
        """Take ``session`` (open in the cache of a range this one contains): same id and object, its blocks
        copied into our pool, widened to our layers."""
        with self.lock:
            if session.session_id in self._sessions:
                raise SessionError(f"session {session.session_id} is already open")
            session.rehome(self)
            self._sessions[session.session_id] = session

    def close(self, session_id: str) -> None:
        with self.lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise SessionError(f"unknown session {session_id}")
            if session.home is self:  # a session carried to another range gives its blocks back there
                session.release()

    def get(self, session_id: str) -> SessionCache:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(f"unknown session {session_id}: open it first (or it expired)")
        return session

    def held_tokens(self, session_ids: Collection[str]) -> int:
        """Tokens the pool holds for these sessions (those open here)."""
        sessions = [self._sessions.get(s) for s in session_ids]  # read from the event loop too
        return sum(s.held_tokens for s in sessions if s is not None)

    def prepare(self, tokens: Mapping[str, int]) -> None:
        """Before a forward call (on the torch thread): each of these sessions holds blocks for its number of
        tokens, idle sessions evicted for them if need be (all or none: CapacityError if they cannot be had),
        and has stepped now."""
        with self.lock:
            sessions = {sid: self.get(sid) for sid in tokens}
            more = sum(
                max(0, math.ceil(t / self.pool.block_tokens) - len(sessions[sid].blocks))
                for sid, t in tokens.items()
            )
            self.make_room(more, set(tokens))
            now = self.clock()
            for sid, t in tokens.items():
                sessions[sid].grow(t, tokens.keys())
                sessions[sid].last_step_s = now

    def make_room(self, blocks: int, protect: Collection[str]) -> None:
        """Free at least ``blocks`` blocks, evicting idle sessions not in ``protect``; CapacityError if even
        that is not enough (nothing is evicted then)."""
        with self.lock:
            short = blocks - self.pool.free_blocks
            if short <= 0:
                return
            victims, freed = [], 0
            for session in self.eviction_order(protect):
                if freed >= short:
                    break
                frees = sum(self.pool.refs[b] == 1 for b in session.blocks)  # a shared block stays held
                if frees:  # one that would free nothing keeps its cache
                    victims.append(session)
                    freed += frees
            if freed < short:
                raise CapacityError(
                    f"KV cache full: {blocks} blocks of {self.pool.block_tokens} tokens wanted, "
                    f"{self.pool.free_blocks} free and {freed} held by idle sessions"
                )
            for session in victims:
                self.evict(session.session_id)

    def eviction_order(self, protect: Collection[str] = ()) -> list[SessionCache]:
        """Sessions that may be evicted, first to go first: idle seconds per held token, highest first."""
        now = self.clock()
        held = [
            s
            for s in list(self._sessions.values())
            if s.blocks and s.session_id not in protect and s.session_id not in self.busy and s.home is self
        ]
        return sorted(held, key=lambda s: ((now - s.last_step_s) / s.held_tokens, s.session_id), reverse=True)

    def evict(self, session_id: str) -> None:
        session = self.get(session_id)
        logger.info(
            "evicting session %s (%d tokens, idle %.1f s)",
            session_id[:8],
            session.held_tokens,
            self.clock() - session.last_step_s,
        )
        session.release()
        session.evicted = True
        self.evictions += 1

    def check_not_evicted(self, session: SessionCache, position: int) -> None:
        """SessionEvicted for a step past position 0 of an evicted session (one at 0 opens it afresh)."""
        if session.evicted and position > 0:
            raise SessionEvicted(
                f"session {session.session_id[:16]} was evicted here (idle while the cache was short): "
                "replay it"
            )

    # --- prefix sharing ---------------------------------------------------------------------------------------

    def attach_prefix(
        self, session: SessionCache, position: int, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """For a step of ``session`` through all our layers at ``position`` (where its own full blocks end) with
        inputs ``hidden`` [T, H]: share the full blocks other sessions computed from the same inputs at the same
        positions (keys chained from position 0), at most all but the step's last token. Returns the range's
        outputs for the shared rows [k * block_tokens, H] (the caller computes only the rows after them), or
        None if nothing was shared."""
        with self.lock:
            size = self.pool.block_tokens
            if (
                session.home is not self  # carried to a wider range: its blocks are in another pool
                or position != len(session.chain) * size
                or len(session.blocks) != len(session.chain)
                or any(n != position for n in session.lengths)
            ):
                return None
            self.prefix_tokens_looked_up += hidden.shape[0]
            shared: list[int] = []
            while (len(shared) + 1) * size < hidden.shape[0]:
                rows = hidden[len(shared) * size : (len(shared) + 1) * size]
                key = _prefix_key(session.chain[-1] if session.chain else b"", rows)
                block = self.pool.index.get(key)
                if block is None:
                    break
                self.pool.hold(block)
                shared.append(block)
                session.chain.append(key)
            if not shared:
                return None
            session._set_blocks(session.blocks + shared)
            session.lengths = [position + len(shared) * size] * len(session.lengths)
            self.prefix_tokens_shared += len(shared) * size
            return torch.cat([self.pool.outputs[b] for b in shared]).to(hidden.device)

    def register_prefix(
        self, session: SessionCache, position: int, hidden: torch.Tensor, outputs: torch.Tensor
    ) -> None:
        """After a step through all our layers at ``position`` with inputs ``hidden`` and ``outputs`` [T, H]:
        offer the full blocks it completed for sharing (continuing the session's chain of prefix keys)."""
        with self.lock:
            if session.home is not self:
                return
            size = self.pool.block_tokens
            while len(session.chain) * size >= position and (len(session.chain) + 1) * size <= position + len(
                hidden
            ):
                j = len(session.chain)
                rows = slice(j * size - position, (j + 1) * size - position)
                key = _prefix_key(session.chain[-1] if session.chain else b"", hidden[rows])
                block = session.blocks[j]
                if key not in self.pool.index and block not in self.pool.hash_of:
                    self.pool.index[key], self.pool.hash_of[block] = block, key
                    # kept in host memory: on a GPU the device's memory is the KV pool's, sized to it
                    self.pool.outputs[block] = outputs[rows].to("cpu", copy=True)
                session.chain.append(key)


def _prefix_key(previous: bytes, rows: torch.Tensor) -> bytes:
    """The key of a block of input rows after the blocks whose key is ``previous``."""
    data = rows.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(previous + data, digest_size=16).digest()
