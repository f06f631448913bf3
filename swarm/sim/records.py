"""The simulation's vocabulary: event kinds, the client's link endpoints, and the mutable Node and Link records.

Every other module of the engine (engine, batching, links, client_side, sessions, moves) reads and writes these
records; they hold state only, no behaviour.
"""

from __future__ import annotations

from collections import deque

from swarm.sim.hosts import Host
from swarm.sim.timing import NodeTiming
from swarm.types import LayerRange, NodeID

ARRIVE, NODE_DONE, DELIVER_DECODE, DELIVER_PREFILL, CLIENT_DECODE, CLIENT_PREFILL, TIMER, HOST_DONE = range(8)
SRC, SNK = -1, -2  # link endpoints for the client side


class Node:
    __slots__ = (
        "id", "alive", "incarnation", "layers", "timing", "cache_total", "cache_used", "decode_q", "prefill_q",
        "busy", "cur_decode", "cur_prefill", "busy_s", "sessions", "host", "decode_iter_s",
        "replay_q", "cur_replay", "cur_replay_tokens", "old_layers", "draining",
    )  # fmt: skip

    def __init__(self, node_id: NodeID) -> None:
        self.id = node_id
        self.alive = False
        self.incarnation = 0
        self.layers: LayerRange | None = None
        self.timing: NodeTiming | None = None
        self.cache_total = 0
        self.cache_used = 0
        self.decode_q: list[int] = []
        self.prefill_q: deque[tuple[int, int]] = deque()
        self.busy = False
        self.cur_decode: list[int] = []
        self.cur_prefill: list[tuple[int, int]] = []
        self.busy_s = 0.0
        self.sessions: set[int] = set()
        self.host: Host | None = None
        self.decode_iter_s: list[float] = []  # seconds of a decode-only iteration of b tokens, b <= batch cap
        self.replay_q: deque[list[int]] = deque()  # [key, tokens left, tokens]: replays, chunked
        self.cur_replay: list[tuple[int, int]] = []  # replays whose last chunk runs in this iteration
        self.cur_replay_tokens = 0
        self.old_layers: LayerRange | None = None  # layers still served to `draining` after a move
        self.draining: set[int] = set()


class Link:
    __slots__ = ("src", "dst", "bandwidth_bytes_s", "latency_s", "free_at", "wait_s", "messages")

    def __init__(self, src: int, dst: int, bandwidth_bytes_s: float, latency_s: float) -> None:
        self.src, self.dst = src, dst  # node indices, or SRC / SNK for the client's side
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.latency_s = latency_s
        self.free_at = 0.0
        self.wait_s = 0.0
        self.messages = 0
