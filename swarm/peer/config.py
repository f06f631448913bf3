"""Every setting of a peer, written once: field, default and help. ``swarm-peer join``'s options are built from
these dataclasses (swarm.settings), and each component takes its own config as a constructor argument.

Units are in the names (``_s``, ``_bytes``, ``_tokens``). Each background loop has its own period.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.dht import P2PD_THREADS, ElectionConfig, ReachabilityConfig
from swarm.settings import component, positive, setting
from swarm.types import DTYPE_BYTES, LayerRange

PLANNER_METHODS = ("milp", "search", "greedy", "swarm", "separate")


@dataclass(frozen=True)
class SessionConfig:
    """Sessions and forwarding (rpc_* handlers)"""

    idle_timeout_s: float = setting(120.0, "close a session with no step for this long, freeing its cache")
    forward_timeout_s: float = setting(
        60.0, "deadline of the call to the next hop (covers the rest of the route)"
    )
    close_timeout_s: float = setting(5.0, "deadline of passing a close down the route")
    dial_back_timeout_s: float = setting(5.0, "deadline of dialling a peer back for its reachability check")
    max_probe_reply_bytes: int = setting(
        4 * 1024**2, "most bytes a probe may ask back (download measurement)"
    )
    max_open: int = setting(1024, "most sessions open on this peer at once")
    # A remote peer is a client or the previous hop of a route (forwarding many clients' sessions): the
    # transport authenticates only the peer that calls us, so that is whose share a session counts against.
    max_sessions_per_remote: int = setting(256, "most sessions one remote peer may hold open on this peer")
    max_remote_cache_fraction: float = setting(0.5, "most of the KV cache one remote peer may reserve")
    max_requests_per_remote: int = setting(64, "most steps one remote peer may have in flight on this peer")
    max_session_lifetime_s: float = setting(
        3600.0, "close a session this long after it opened, however busy (the client then replays it)"
    )
    reap_interval_s: float = setting(5.0, "how often idle sessions are looked for")
    # Chunks of one pipelined prompt overtake each other by milliseconds; the bound delays the answer to a
    # step of a session that expired (SessionError, and the client replays) by as much.
    order_wait_s: float = setting(
        1.0, "how long a session's later step waits for its first step to arrive and open the session"
    )

    def __post_init__(self) -> None:
        positive(self, "idle_timeout_s", "forward_timeout_s", "close_timeout_s", "dial_back_timeout_s")
        positive(self, "max_open", "reap_interval_s", "max_probe_reply_bytes", "max_sessions_per_remote")
        positive(self, "max_requests_per_remote")
        positive(self, "max_session_lifetime_s", "order_wait_s")
        if not 0 < self.max_remote_cache_fraction <= 1:
            raise ValueError(
                f"max_remote_cache_fraction must be in (0, 1], got {self.max_remote_cache_fraction}"
            )


@dataclass(frozen=True)
class ExecutorConfig:
    """The torch executor of one device"""

    queue_jobs: int = setting(256, "jobs waiting for the torch thread; past this, requests get CapacityError")
    max_batch: int = setting(16, "most steps (of different sessions) fused into one forward call")
    max_batch_tokens: int = setting(
        288, "most tokens in one forward call (prefill chunks of different sessions share one while they fit)"
    )
    prefill_chunk_tokens: int = setting(
        256, "a longer prefill runs in chunks of this many tokens; other sessions' steps run between them"
    )
    # Decode steps run on their own thread, but on one GPU their kernels still queue behind a running chunk's,
    # and a chunk holds its session and the peer's session calls (open, move) until it ends. Small chunks keep
    # that wait short while others decode; big ones waste less per-call overhead when nobody does
    # (scripts/bench_prefill.py measures both).
    busy_chunk_tokens: int = setting(
        32, "prefill chunk size while other sessions decode here (at most prefill_chunk_tokens)"
    )
    # A chat prompt cut into busy chunks took its peer's prefill turns once per chunk, and the prompts of
    # sessions that began together ran one chunk per call, one after another behind the first ones' decode
    # steps. A prompt this short now runs whole, and whole prompts of several sessions share a call up to this
    # many tokens. 8 generations one client started at once (37-token prompts, 3 peers on 2 cores; paired, 5
    # rounds): the last first token came 2.29-3.00 s (median 2.45) after the start against 3.34-4.52 (3.88) with
    # 32, earlier in every pair; 73.5 against 64.5 tok/s (medians, noisy); the longest decode gap 242 against
    # 211 ms. 8 client processes lost a little (scripts/bench_e2e.py --ab, 4 rounds: B / A 0.88-1.00, median
    # 0.94), likely because sessions that start together step as one group, which passes the peers one hop at
    # a time, where staggered ones formed groups that overlapped on the two cores (not traced). A long prompt's
    # chunks stay at busy_chunk_tokens, which is what keeps decode steps' latency: with 128 for those too,
    # decode p99 during a 2048-token prefill rose from 2.2-2.4x to 2.3-2.8x the p50 alone.
    busy_prompt_tokens: int = setting(
        128,
        "while other sessions decode here, prompts of at most this many tokens run whole, several sessions'"
        " in one call up to this many tokens (at most prefill_chunk_tokens)",
    )
    decode_recent_s: float = setting(
        2.0, "other sessions count as decoding for this long after their last one-token step here"
    )
    # Prefill chunks run on a second torch thread at a lower OS priority than decode steps: on a machine with
    # fewer cores than busy torch threads (every peer of a pipelined prompt computes at once), the scheduler
    # then gives a decode step the core at once instead of a share of it behind the chunks.
    prefill_nice: int = setting(
        10, "OS niceness (0-19) of the thread that runs prefill chunks, above the decode thread's"
    )
    # Niceness ranks the threads of one process, but each peer is a process of its own (on Linux its own autogroup),
    # so another peer's prefill thread still met a decode step as an equal. The idle policy (SCHED_IDLE) ranks
    # it below the decode threads of its session: a waking decode thread preempts a prefill thread at once, and a
    # core that runs only prefill threads counts as free when the scheduler places it. Two paired probes, 4
    # sessions decoding during a 2048-token prefill (3 peers on 2 cores, 3 rounds each): decode p99 206.5 / 202.0
    # / 200.6 and 220.0 / 232.1 / 215.7 ms against 226.7 / 216.8 / 224.7 and 254.8 / 245.6 / 221.5 with niceness
    # alone, lower in each of 6 pairs, the prefill 63-74 against 63-73 s; 8 client processes, paired A/B of 4
    # rounds (scripts/bench_e2e.py --ab): median 1.01.
    # Linux weighs sessions (autogroups) as equals before the threads in them, so against another session's
    # threads the idle policy counts only in placement, and a prefill thread keeps its peer's share of the machine
    # beside other peers. Peers started in one session instead (a probe, reverted: Popen(process_group=0) in
    # swarm/testing/launcher.py; 2 vCPUs of a Zen 4, paired rounds of two swarms side by side): decode p99
    # during a 2048-token prefill 0.85 and 0.87 of the p99 with a session each (medians of 6 rounds, lower in 12
    # of 12), but one client's 16 sessions 0.60-0.67x as fast and the last first token of 8 client processes
    # 1.6x later (4-5 rounds): the sessions' chat prompts, on the prefill thread too, then waited behind every
    # decode step of the machine. With those on a second, normal-policy thread (a probe: the peers in one session
    # apart from the clients), one client's 16 sessions 1.10x and first tokens as before, but one client's 8
    # sessions 0.89x and the p99 gain gone to 0.97 (4 rounds); at niceness 10 on that thread, the p99 0.92x but
    # 16 sessions 0.67x and first tokens 1.44x later again. Peers keep a session each.
    prefill_idle: bool = setting(
        True,
        "run prefill chunks under the OS's idle scheduling policy (Linux SCHED_IDLE), below this peer's decode steps",
        flag="--executor-no-prefill-idle",
    )
    # Niceness gives decode the core, not the GIL, the caches and the hand-offs around it: three peers on one
    # machine prefilling one long prompt at once (pipelined) slowed every part of a decode round, each hop's
    # forward call, the hops between them and the client's head. The peers of one device now take turns for
    # their chunks while sessions decode there (swarm/peer/turns.py), and a chunk waits between two layers for a
    # decode call running beside it. With both, a pause between chunks no longer helps: share 0.5 against 1,
    # decode p99 during a 2048-token prefill 67-71 against 68-70 ms, the prefill 12.3-13.2 against 10.9-11.3 s
    # (scripts/bench_e2e.py, 2 cores); before, the pause had held that p99 near 2x the p50 alone.
    prefill_turns: bool = setting(
        True,
        "let prefill chunks run beside those of other peers on this device while sessions decode here",
        flag="--executor-no-prefill-turns",
    )
    # A chunk of a long prompt (longer than prefill_chunk_tokens) can also wait between two layers for the decode
    # calls of the other peers on this device (they share its cores; swarm/peer/turns.py, DecodeCalls), at most
    # this long per layer; shorter prefills wait only for this peer's. Sarathi's trade: the decode steps keep
    # their pace and the long prompt takes longer. 4 sessions decoding during a 2048-token prefill (3 peers on
    # 2 cores, paired probes of 3 rounds), at 20 ms: decode p99 129-215 against 146-233 ms, lower in each of 6
    # pairs (p99 / p50 alone, medians 1.71 and 1.77 against 2.23 and 2.31), the prefill 46-73 against 33-42 s;
    # in a slower spell 223 / 233 / 240 against 231 / 242 / 294 ms (p99 / p50 alone, median 2.00 against 2.44),
    # the prefill 67-73 against 50-57 s. 8 ms did not lower the p99 (200-207 ms). Only long prompts wait: when
    # every prompt cut into chunks while others decode waited too (a 37-token chat prompt is more than one busy
    # chunk), one client starting 8 generations at once reached 29.7-32.5 against 48.1-59.5 tok/s (paired, 4
    # rounds); held to long prompts, 29.3 against 32.0 (median of 4 pairs, beside a test run: noise).
    device_decode_wait_s: float = setting(
        0.02,
        "between two layers a long prefill's chunk waits at most this long for decode calls of other peers"
        " on this device (0: never)",
    )
    busy_prefill_share: float = setting(
        1.0,
        "while other sessions decode here, prefill chunks run at most this share of the time (1: no pause)",
    )

    # A short prefill (a spot-check's window, a short next turn) on the prefill thread reads every weight of the
    # range once more, beside the decode steps' forward call that reads them too. While others decode here (a decode
    # step came within the wait it would have, see ride_wait_s) it rides in the decode lane's next forward call
    # instead, as a few more rows of the same products. At 8 client processes on 2 cores (scripts/bench_e2e.py,
    # default spot-checks) the peers' prefill threads fell from ~3 to ~1.5 ms of CPU per generated token, and 8
    # processes gained ~4% (alternated probes: 104.0 against 100.0 tok/s, means of 7 and 9 runs). The prefills
    # riding in one call hold busy_chunk_tokens at most, as a prefill call would while others decode. It rides only
    # if its rows leave the call's products in the form they take without it (swarm.models.matmul.Forms.form):
    # a 4-bit decode call of the default model went through F.linear with a 16-token window, 2 decode steps
    # 45-56 ms of CPU against 14 (traced); not riding then, 8 client processes gained (paired A/B of
    # ride_along_tokens 0, 4 rounds: median 1.14) and their peers' decode lanes spent 12.7 against 23.1 ms of CPU
    # per generated token (scripts/bench_e2e.py, session 26 against 25).
    ride_along_tokens: int = setting(
        16,
        "a prefill of at most this many tokens that comes while others decode here runs in the next decode"
        " forward call (0: never)",
    )
    # Decode steps come here once a period: the route's round, or less with several groups of sessions. On a
    # slow CPU that is longer than batch_window_s (2 vCPUs of a Zen 3, 8 client processes: a round every
    # ~220 ms), and a riding prefill that waited only the window then ran alone on the decode lane, holding
    # back the steps that came just after it (traced: 4-15 such calls of 50-120 ms per peer in 45 s). It waits
    # for the next decode call instead, one period plus batch_window_s (at most this long), and if none comes
    # it goes to the prefill thread rather than run alone in the decode steps' way. Traced after (same load):
    # no such call; prefill-thread calls per peer 21-46 -> 2-9. 8 client processes against the wait held to
    # batch_window_s (scripts/bench_e2e.py --ab, 6 paired rounds): 26.0 against 23.5 tok/s
    # median, B / A 0.94-1.19 round by round, median 1.09 (a first probe of the same kind: median 1.06).
    ride_wait_s: float = setting(
        0.5,
        "a prefill riding along waits at most this long for the next decode forward call here (its period"
        " plus batch_window_s); then it runs on the prefill thread",
    )
    # Lone sessions of separate clients decoding here each come back at their own pace: an idle executor would
    # start each one alone, and the rest would wait a whole forward call for it. Waiting a little for the ones
    # due makes one batch of them, and fewer, bigger forward calls cost less per token (batch of 8 decode
    # steps ~1.6x one step). On 2 shared cores (scripts/bench_e2e.py, 8 client processes) 10 ms left a batch
    # of ~2 steps and 25 ms ~3. 80 ms lets two groups half a period apart merge: traced, one batch of 8 per hop
    # within ~1 s, a round every ~70 ms. While every hop waited by pace, 80 ms also stalled 4 processes in two
    # runs of five (49 and 57 tok/s against 72-82): a hop waited for sessions held at another hop, waiting in
    # turn. Now only a route's first hop waits by pace (later hops get the steps of one forward call as a group):
    # 8 processes 104.4 / 100.9 tok/s at 80 ms against 90.6 / 92.0 at 25, 4 processes 80.7 / 82.1 / 84.2
    # against 74.1 / 75.4 / 77.2 (alternated runs).
    batch_window_s: float = setting(
        0.08, "a decode step waits at most this long for lone sessions due here by their pace (0: never)"
    )
    # A client sends its sessions' steps of one round one after another, ~1 ms apart: 16 of them take longer
    # than batch_window_s to arrive, and they are known to come (StepRequest.batch_size).
    group_window_s: float = setting(
        0.05,
        "a decode step waits at most this long for the rest of the steps its client sent with it (0: never)",
    )

    # Lone sessions waited for by pace all ran as one batch, which then passed the route's hops one after another
    # with one of them working at a time. Two groups keep two hops busy (pipeline micro-batches; the client's
    # batch_lanes does the same for its own sessions): 8 client processes on 2 vCPUs of a Zen 4, 3 peers x 10
    # layers of the default model, 109.8 against 93.5 tok/s with one group (medians of 4 paired rounds, B / A
    # 1.09-1.38, median 1.19: scripts/bench_e2e.py --peer-args "--executor-paced-groups 1" --ab "" --sessions 8);
    # batches held to 4 by --executor-max-batch instead gave 1.11, and three groups against two 0.95 (0.90-1.04).
    paced_groups: int = setting(
        2,
        "lone sessions batched by their pace at a route's first hop go in this many groups at most (1: one)",
    )

    def __post_init__(self) -> None:
        positive(self, "queue_jobs", "max_batch", "max_batch_tokens", "prefill_chunk_tokens", "paced_groups")
        positive(self, "busy_chunk_tokens", "busy_prompt_tokens", "decode_recent_s")
        if self.ride_along_tokens < 0:
            raise ValueError("ride_along_tokens must be >= 0")
        if self.device_decode_wait_s < 0:
            raise ValueError(f"device_decode_wait_s must be >= 0, got {self.device_decode_wait_s}")
        if self.batch_window_s < 0 or self.group_window_s < 0 or self.ride_wait_s < 0:
            raise ValueError("batch_window_s, group_window_s and ride_wait_s must be >= 0")
        if not 0 < self.busy_prefill_share <= 1:
            raise ValueError(f"busy_prefill_share must be within (0, 1], got {self.busy_prefill_share}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be within 0-19, got {self.prefill_nice}")


@dataclass(frozen=True)
class LinkConfig:
    """Link measurement to other peers"""

    refresh_s: float = setting(30.0, "how often links to other peers are re-measured")
    nearest: int = setting(4, "the k lowest-RTT peers measured last time are always re-measured")
    sample: int = setting(2, "plus this many other peers picked at random")
    payload_bytes: int = setting(256 * 1024, "bandwidth probe size")
    timeout_s: float = setting(5.0, "deadline of one probe")
    poll_s: float = setting(2.0, "how often to look for newly joined peers to measure")

    def __post_init__(self) -> None:
        positive(self, "refresh_s", "payload_bytes", "timeout_s", "poll_s")
        if self.nearest < 0 or self.sample < 0:
            raise ValueError("nearest and sample must be >= 0")


@dataclass(frozen=True)
class FollowConfig:
    """Following the published plan"""

    check_interval_s: float = setting(5.0, "how often to look for a new plan epoch (and during a handover)")
    handover_timeout_s: float = setting(
        60.0, "longest wait for others to take layers we drop; then drop them"
    )
    max_move_layers: int = setting(
        0, "most layers held at once while moving (0: old + new); past it, old layers go before new ones load"
    )
    session_grace_s: float = setting(
        3600.0,
        "safety bound: a range we stop serving is dropped once its sessions end or move, at the latest "
        "after this long (or the session lifetime, if shorter)",
    )

    def __post_init__(self) -> None:
        positive(self, "check_interval_s", "handover_timeout_s")
        if self.session_grace_s < 0:
            raise ValueError(f"session_grace_s must be >= 0, got {self.session_grace_s}")
        if self.max_move_layers < 0:
            raise ValueError(f"max_move_layers must be >= 0, got {self.max_move_layers}")


@dataclass(frozen=True)
class PlannerConfig:
    """The elected planner"""

    period_s: float = setting(60.0, "re-solve at least this often")
    check_interval_s: float = setting(5.0, "how often to look for membership or measurement changes")
    solve_time_limit_s: float = setting(20.0, "MILP time limit per solve")
    method: str = setting("milp", "swarm.planner.solve method", choices=PLANNER_METHODS)
    # The publish margin. Improvements start from the published plan, so an unchanged swarm never yields a
    # worse candidate (no solver-noise thrash); the margin guards against noise in measured peer speeds and
    # makes each move pay. Measured on helix24 (scripts/bench_churn.py, each node leaving in turn, 3 s solves):
    # the 2-move epochs after an L4 or T4 leave gained 7-12% each and are kept at 5%; after an A100 leave the
    # best 2 moves gained 0-3.9% per epoch (e.g. 1549 -> 1592 -> 1646 tokens/s with no margin), gains that
    # speed-measurement noise can fake, and are refused. Petals' 1.33x guards one server's unpriced, uncapped
    # move of all its blocks; ours are capped and priced, so a smaller margin suffices.
    improve_fraction: float = setting(
        0.05, "publish a working plan's replacement only when its max flow is this much higher"
    )
    change_fraction: float = setting(0.20, "a measured speed or memory change this large triggers a re-solve")
    # Positive so that among placements of equal flow (common: identical peers) the solver keeps what peers
    # hold instead of swapping ranges for nothing.
    reload_cost_tokens_s: float = setting(0.1, "objective charged per layer a peer must load anew")
    # Local branching: one leave of helix24 (24 nodes) is repaired with 0 moves (every layer has 2+ holders),
    # then each periodic improvement moves at most this many. bench_churn.py, 6 leaves (A100, L4s, T4s), 3
    # epochs, flow kept vs a from-scratch re-solve (which moves ~21): cap 1 stalls at 0.84 (0.5 moves in all);
    # cap 2 reaches 0.91 (2.0 moves); cap 4 reaches 0.90 (2.5 moves, all in one epoch). 2 keeps 22 of 24 peers
    # untouched per epoch at no loss of flow against 4.
    max_moves: int = setting(2, "most peers one re-plan may move off their layers (a repair may need more)")
    move_cost_fraction: float = setting(
        0.01, "objective charged per peer whose layers change, as a fraction of the current max flow"
    )
    spare_replicas: int = setting(
        1, "holders per layer beyond the first, where memory allows without losing flow"
    )
    client_bandwidth_bytes_s: float = setting(12.5e6, "client <-> peer bandwidth (unmeasured; 100 Mbit/s)")
    client_latency_s: float = setting(0.02, "client <-> peer latency (unmeasured)")
    unmeasured_bandwidth_bytes_s: float | None = setting(12.5e6, "bandwidth of peer pairs with no probe yet")
    # Plausibility caps on what peers announce: anyone can write a record, and one absurd number would pull
    # the whole plan's flow through its writer.
    max_layer_tokens_s: float = setting(1e6, "announced decode tokens/s per layer above this count as this")
    max_link_bandwidth_bytes_s: float = setting(12.5e9, "announced link bandwidth above this counts as this")
    min_reporters: int = setting(
        2, "leave out peers reported for wrong outputs by this many reporters (0: never)"
    )

    def __post_init__(self) -> None:
        positive(self, "period_s", "check_interval_s", "solve_time_limit_s", "client_bandwidth_bytes_s")
        positive(self, "max_layer_tokens_s", "max_link_bandwidth_bytes_s")
        if self.min_reporters < 0:
            raise ValueError(f"min_reporters must be >= 0, got {self.min_reporters}")
        if self.improve_fraction < 0 or self.change_fraction < 0 or self.move_cost_fraction < 0:
            raise ValueError("improve_fraction, change_fraction and move_cost_fraction must be >= 0")
        if self.max_moves < 0 or self.spare_replicas < 0:
            raise ValueError("max_moves and spare_replicas must be >= 0")


@dataclass(frozen=True)
class PeerConfig:
    """One peer of the swarm (``swarm-peer join``)."""

    initial_peers: tuple[str, ...] = setting(
        (), "peers to join via; none starts a new swarm", metavar="MADDR"
    )
    model: str = setting("default", "default | tiny[:SEED] | checkpoint dir")
    device: str = setting("cpu", "cpu | cuda | cuda:N")
    dtype: str | None = setting(
        None, "weights and activations (default: float32 on CPU, bfloat16 on GPU)", choices=tuple(DTYPE_BYTES)
    )
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "port to listen on (0: any free)")
    p2pd_threads: int = setting(
        P2PD_THREADS, "Go threads of our p2pd daemon (GOMAXPROCS; 0: Go's default, a thread per core)"
    )
    layers: str = setting("auto", "auto (least-covered window that fits in memory) | A:B for layers [A, B)")
    max_memory_gb: float | None = setting(None, "memory budget (default: measured from the device)")
    cache_tokens: int = setting(8192, "KV-cache budget in tokens, shared by all sessions")
    name: str = setting("", "human-readable name shown in status (default: end of the peer id)")
    identity_path: str | None = setting(
        None, "persistent peer identity key", flag="--identity", metavar="KEYFILE"
    )
    maddr_file: str | None = setting(None, "write our multiaddrs here once serving", metavar="FILE")
    record_ttl_s: float = setting(30.0, "our DHT record expires this long after we stop refreshing it")
    shutdown_grace_s: float = setting(10.0, "on SIGINT/SIGTERM, how long open sessions may finish")
    plan: bool = setting(True, "never stand for planner", flag="--no-plan")
    follow_plan: bool = setting(True, "keep our layers whatever the plan says", flag="--no-follow-plan")
    faulty_output_rate: float = setting(
        0.0, "TEST ONLY: add noise to this fraction of our step outputs (a lying peer, for spot-check tests)"
    )
    faulty_skip_rate: float = setting(
        0.0,
        "TEST ONLY: on this fraction of the steps we should forward, skip the hops after us and return our own "
        "output with faked timings (a lying forwarder, for spot-check tests)",
    )
    reachability: ReachabilityConfig = component(ReachabilityConfig)
    sessions: SessionConfig = component(SessionConfig, prefix="session")
    executor: ExecutorConfig = component(ExecutorConfig, prefix="executor")
    links: LinkConfig = component(LinkConfig, prefix="link")
    follow: FollowConfig = component(FollowConfig, prefix="follow")
    election: ElectionConfig = component(ElectionConfig, prefix="planner")
    planner: PlannerConfig = component(PlannerConfig, prefix="planner")

    def __post_init__(self) -> None:
        if self.layers != "auto":
            LayerRange.parse(self.layers)  # raises ValueError with a clear message
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"unknown device {self.device!r}: use cpu, cuda or cuda:N")
        positive(self, "cache_tokens", "max_memory_gb", "record_ttl_s")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range 0..65535")
        if self.p2pd_threads < 0:
            raise ValueError(f"p2pd_threads must be >= 0, got {self.p2pd_threads}")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        for name in ("faulty_output_rate", "faulty_skip_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
