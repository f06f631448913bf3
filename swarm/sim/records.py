"""The simulation's vocabulary: event kinds, the client's link endpoints, and the mutable records of nodes,
links, requests and churn counters.

The engine's parts (batching, links, client_side, sessions, moves) share these records; they hold state and
answer questions about it, and change only through the parts that own each step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from swarm.sim.hosts import Host
from swarm.sim.timing import NodeTiming
from swarm.sim.trace import Request
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


class Requests:
    """Per-request progress, one list entry per request of the trace (plain lists: the hot loops index them).

    Tokens in flight carry a key, request << 8 | (epoch & 255): bumping a request's epoch makes every token of
    it still in flight stale, wherever it is."""

    def __init__(self, trace: list[Request]) -> None:
        n = len(trace)
        self.trace = trace
        self.routes: list[tuple[int, ...]] = [()] * n  # node indices, stage by stage
        self.stage_starts: list[tuple[int, ...]] = [()] * n  # first layer of each stage
        self.stage = [0] * n  # the stage the request's tokens are at (or head for)
        self.epoch = [0] * n
        self.generated = [0] * n
        self.out_len = [req.output_tokens for req in trace]
        self.first_token_s = [-1.0] * n
        self.done_s = [-1.0] * n
        self.replay_end = [0] * n  # a replay's prefill returns to the client before this stage
        self.resume_stage = [0] * n  # after a replay, the pending decode step re-enters here
        self.replaying = [False] * n
        # Split phases: the decode route a session moves to after its prompt (empty: it decodes where it prefilled)
        self.decode_routes: list[tuple[int, ...]] = [()] * n
        self.decode_starts: list[tuple[int, ...]] = [()] * n

    def key(self, r: int) -> int:
        return r << 8 | (self.epoch[r] & 255)

    def session_tokens(self, r: int) -> int:
        """KV cache a session reserves on each stage: its whole prompt and output."""
        return self.trace[r].prompt_tokens + self.trace[r].output_tokens

    def prompt_kv_tokens(self, r: int) -> int:
        """KV cache a split session reserves on a prefill-only stage: its prompt and first token."""
        return self.trace[r].prompt_tokens + 1

    def length(self, r: int) -> int:
        """Tokens the session holds now: its prompt and what it generated so far."""
        return self.trace[r].prompt_tokens + self.generated[r]


@dataclass
class Counters:
    """What churn cost the sessions."""

    failovers: int = 0
    restarts: int = 0
    handovers: int = 0
    replayed_tokens: int = 0  # token x stage: tokens re-prefilled by replacement stages
    handover_bytes: int = 0
    phase_moves: int = 0  # split phases: sessions whose KV moved from the prefill to the decode route
    phase_move_bytes: int = 0
    phase_move_s: float = 0.0  # summed over those sessions: prompt done -> KV on every decode stage
