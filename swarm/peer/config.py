"""Every setting of a peer, written once: field, default and help. ``swarm-peer join``'s options are built from
these dataclasses (swarm.settings), and each component takes its own config as a constructor argument.

Units are in the names (``_s``, ``_bytes``, ``_tokens``). Each background loop has its own period.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.codec import ActivationConfig
from swarm.dht import P2PD_THREADS, DirectoryConfig, ElectionConfig, ReachabilityConfig
from swarm.dht.trust import MAX_LAYER_TOKENS_S, MIN_REPORTERS
from swarm.dht.watch import WatchConfig
from swarm.planner import TIME_LIMIT_S
from swarm.planner.replan import ReplanConfig
from swarm.planner.split import SplitConfig
from swarm.routing.route import RoutingConfig
from swarm.settings import component, positive, setting
from swarm.types import DTYPE_BYTES, QUANT_KINDS, LayerRange

PLANNER_METHODS = ("milp", "search", "greedy", "swarm", "separate")
SHARED_DEVICE_MODES = ("auto", "on", "off")  # ExecutorConfig.shared_device


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
        256 * 1024,
        "most bytes a probe may ask back (download measurement; the largest link probe by default)",
    )
    max_open: int = setting(1024, "most sessions open on this peer at once")
    # A remote peer is a client or the previous hop of a route (forwarding many clients' sessions): the
    # transport authenticates only the peer that calls us, so that is whose share a session counts against.
    max_sessions_per_remote: int = setting(256, "most sessions one remote peer may hold open on this peer")
    max_remote_cache_fraction: float = setting(0.5, "most of the KV cache one remote peer may hold")
    evict_idle_s: float = setting(
        1.0,
        "a session idle this long counts its KV cache as free in announcements (evicted for a newcomer)",
    )
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
    # A close that overtook the session's first step (its client went away while the step was on its way, or
    # the hop before us forwarded the step after passing the close on) must not let that step open it after.
    closed_memory_s: float = setting(
        10.0, "how long a session closed by its client stays closed here to steps still on their way"
    )
    share_prefixes: bool = setting(
        False,
        "share the KV cache blocks of prompts that begin alike (copy-on-write)",
        flag="--session-share-prefixes",
    )
    activations: ActivationConfig = component(ActivationConfig, prefix="activations")

    def __post_init__(self) -> None:
        positive(self, "idle_timeout_s", "forward_timeout_s", "close_timeout_s", "dial_back_timeout_s")
        positive(self, "max_open", "reap_interval_s", "max_probe_reply_bytes", "max_sessions_per_remote")
        positive(self, "max_requests_per_remote")
        positive(self, "max_session_lifetime_s", "order_wait_s", "evict_idle_s", "closed_memory_s")
        if not 0 < self.max_remote_cache_fraction <= 1:
            raise ValueError(
                f"max_remote_cache_fraction must be in (0, 1], got {self.max_remote_cache_fraction}"
            )


@dataclass(frozen=True)
class ExecutorConfig:
    """The torch executor of one device (its policy: swarm/peer/schedule.py; measured effects: docs/benchmarks.md)"""

    queue_jobs: int = setting(256, "jobs waiting for the torch thread; past this, requests get CapacityError")
    max_batch: int = setting(16, "most steps (of different sessions) fused into one forward call")
    max_batch_tokens: int = setting(
        288, "most tokens in one forward call (prefill chunks of different sessions share one while they fit)"
    )
    prefill_chunk_tokens: int = setting(
        256, "a longer prefill runs in chunks of this many tokens; other sessions' steps run between them"
    )
    # Small chunks keep the wait of decode steps (and of session calls) behind a chunk short; big ones waste
    # less per-call overhead when nobody decodes.
    busy_chunk_tokens: int = setting(
        32, "prefill chunk size while other sessions decode here (at most prefill_chunk_tokens)"
    )
    # A chat prompt runs whole rather than in busy chunks, so the first tokens of sessions that begin together
    # come sooner; long prompts stay in busy chunks, which keeps the decode steps' latency.
    busy_prompt_tokens: int = setting(
        128,
        "while other sessions decode here, prompts of at most this many tokens run whole, several sessions'"
        " in one call up to this many tokens (at most prefill_chunk_tokens)",
    )
    decode_recent_s: float = setting(
        2.0, "other sessions count as decoding for this long after their last one-token step here"
    )
    # Turns, the prefill thread's priority and waits for other peers' decode calls (swarm/peer/turns.py) help
    # only peers that share one device; a lone peer goes without them.
    shared_device: str = setting(
        "auto",
        "what peers sharing this device do for each other's decode steps: auto (on while another peer holds"
        " the device), on, off",
        choices=SHARED_DEVICE_MODES,
    )
    # A short prefill (a spot-check's window) rides as a few more rows of the decode steps' call instead of
    # reading every weight once more in a call of its own, if its rows keep that call's form of products.
    ride_along_tokens: int = setting(
        16,
        "a prefill of at most this many tokens that comes while others decode here runs in the next decode"
        " forward call (0: never)",
    )
    # A riding prefill waits for the next decode call (one period of them plus batch_window_s), else it goes
    # to the prefill thread rather than run alone in the decode steps' way.
    ride_wait_s: float = setting(
        0.5,
        "a prefill riding along waits at most this long for the next decode forward call here (its period"
        " plus batch_window_s); then it runs on the prefill thread",
    )
    # Lone sessions of separate clients come back at their own pace; waiting a little for the ones due makes
    # one batch of them, and fewer, bigger forward calls cost less per token. Only a route's first hop waits.
    batch_window_s: float = setting(
        0.08, "a decode step waits at most this long for lone sessions due here by their pace (0: never)"
    )
    # A client sends its sessions' steps of one round one after another, and they are known to come
    # (StepRequest.batch_size).
    group_window_s: float = setting(
        0.05,
        "a decode step waits at most this long for the rest of the steps its client sent with it (0: never)",
    )
    # Two groups keep two hops busy (pipeline micro-batches) where one batch would pass the hops one at a time.
    paced_groups: int = setting(
        2,
        "lone sessions batched by their pace at a route's first hop go in this many groups at most (1: one)",
    )

    def __post_init__(self) -> None:
        positive(self, "queue_jobs", "max_batch", "max_batch_tokens", "prefill_chunk_tokens", "paced_groups")
        positive(self, "busy_chunk_tokens", "busy_prompt_tokens", "decode_recent_s")
        if self.ride_along_tokens < 0:
            raise ValueError("ride_along_tokens must be >= 0")
        if self.batch_window_s < 0 or self.group_window_s < 0 or self.ride_wait_s < 0:
            raise ValueError("batch_window_s, group_window_s and ride_wait_s must be >= 0")
        if self.shared_device not in SHARED_DEVICE_MODES:
            raise ValueError(
                f"shared_device must be one of {SHARED_DEVICE_MODES}, got {self.shared_device!r}"
            )


@dataclass(frozen=True)
class LinkConfig:
    """Link measurement to other peers"""

    refresh_s: float = setting(30.0, "how often links to other peers are re-measured")
    nearest: int = setting(4, "the k lowest-RTT peers measured last time are always re-measured")
    sample: int = setting(2, "plus this many other peers picked at random")
    payload_bytes: int = setting(256 * 1024, "largest bandwidth probe, each way")
    min_payload_bytes: int = setting(32 * 1024, "first bandwidth probe each way; later ones sized by it")
    probe_s: float = setting(0.05, "target time of a sized bandwidth probe on the link")
    timeout_s: float = setting(5.0, "deadline of one probe")
    poll_s: float = setting(2.0, "how often to look for newly joined peers to measure")
    bandwidth_refresh_s: float = setting(
        3600.0, "how often a nearest peer's bandwidth is probed again (RTT: every refresh)"
    )
    later_payload_bytes: int = setting(
        64 * 1024,
        "largest bandwidth probe each way once the first k links are measured (a peer new among the k, a "
        "re-measure)",
    )
    later_rounds: int = setting(2, "most bandwidth probes each way of such a later measurement")
    later_gap_s: float = setting(300.0, "at most one such later measurement this often")

    def __post_init__(self) -> None:
        positive(self, "refresh_s", "payload_bytes", "min_payload_bytes", "probe_s", "timeout_s", "poll_s")
        positive(self, "bandwidth_refresh_s", "later_payload_bytes", "later_rounds", "later_gap_s")
        if self.min_payload_bytes > self.payload_bytes:
            raise ValueError("min_payload_bytes must be <= payload_bytes")
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
    solve_time_limit_s: float = setting(TIME_LIMIT_S, "MILP time limit per solve")
    method: str = setting(ReplanConfig.method, "swarm.planner.solve method", choices=PLANNER_METHODS)
    # Improvements start from the published plan, so an unchanged swarm never yields a worse candidate; the
    # margin guards against noise in measured peer speeds and makes each move pay (docs/benchmarks.md).
    improve_fraction: float = setting(
        ReplanConfig.gain_fraction,
        "publish a working plan's replacement only when its max flow is this much higher",
    )
    change_fraction: float = setting(0.20, "a measured speed or memory change this large triggers a re-solve")
    # Lower than change_fraction: a re-flow moves nobody, while a slow link left with a sixth of the flow is
    # a sixth of the sessions waiting on it.
    reflow_fraction: float = setting(
        0.05,
        "publish a re-flow (same placement, flows on re-measured links) when this share of the flow moves",
    )
    # Peers of uneven speed push one's surplus through the only other way across, however slow that link is.
    slow_flow_give: float = setting(
        0.1, "share of the max flow a published plan's flows may give up to keep tokens off slow links"
    )
    # Positive so that among placements of equal flow (common: identical peers) the solver keeps what peers
    # hold instead of swapping ranges for nothing.
    reload_cost_tokens_s: float = setting(
        ReplanConfig.reload_cost_tokens_s, "objective charged per layer a peer must load anew"
    )
    # Local branching: a repair moves what it must, then each periodic improvement moves at most this many,
    # which keeps most peers untouched per epoch (docs/benchmarks.md).
    max_moves: int = setting(
        ReplanConfig.max_moves, "most peers one re-plan may move off their layers (a repair may need more)"
    )
    move_cost_fraction: float = setting(
        ReplanConfig.move_cost_fraction,
        "objective charged per peer whose layers change, as a fraction of the current max flow",
    )
    spare_replicas: int = setting(
        ReplanConfig.spare_replicas,
        "holders per layer beyond the first, where memory allows without losing flow",
    )
    client_bandwidth_bytes_s: float = setting(12.5e6, "client <-> peer bandwidth (unmeasured; 100 Mbit/s)")
    client_latency_s: float = setting(0.02, "client <-> peer latency (unmeasured)")
    unmeasured_bandwidth_bytes_s: float | None = setting(12.5e6, "bandwidth of peer pairs with no probe yet")
    # Not 0: the slow-link rule would take an unmeasured pair for the fastest link of all and pile flow on it.
    unmeasured_latency_s: float = setting(
        RoutingConfig.default_latency_s, "one-way latency of peer pairs with no probe yet (as routes assume)"
    )
    # Plausibility caps on what peers announce: anyone can write a record, and one absurd number would pull
    # the whole plan's flow through its writer.
    max_layer_tokens_s: float = setting(
        MAX_LAYER_TOKENS_S, "announced decode tokens/s per layer above this count as this"
    )
    max_link_bandwidth_bytes_s: float = setting(12.5e9, "announced link bandwidth above this counts as this")
    min_reporters: int = setting(
        MIN_REPORTERS, "leave out peers reported for wrong outputs by this many reporters (0: never)"
    )
    # Off by default: a split plan's flows carry prompt tokens, which clients read only once they route the
    # two phases apart (swarm.types.Plan.decode_flows).
    split_phases: bool = setting(
        False, "plan prefill and decode as two flows over the placement where that serves more requests"
    )
    split_min_gain: float = setting(
        SplitConfig.min_gain, "split the phases only when that serves this fraction more requests/s"
    )
    split_session_tokens_s: float = setting(
        SplitConfig.session_tokens_s, "decode tokens/s one session gets, for the KV memory bound"
    )
    split_prompt_tokens_per_output: float = setting(
        SplitConfig.prompt_tokens_per_output, "the workload's prompt tokens per generated token"
    )

    def __post_init__(self) -> None:
        positive(self, "period_s", "check_interval_s", "solve_time_limit_s", "client_bandwidth_bytes_s")
        positive(self, "split_session_tokens_s", "split_prompt_tokens_per_output")
        positive(self, "max_layer_tokens_s", "max_link_bandwidth_bytes_s")
        if self.min_reporters < 0:
            raise ValueError(f"min_reporters must be >= 0, got {self.min_reporters}")
        fractions = (
            self.improve_fraction,
            self.change_fraction,
            self.reflow_fraction,
            self.move_cost_fraction,
            self.split_min_gain,
        )
        if min(fractions) < 0 or not 0 <= self.slow_flow_give < 1:
            raise ValueError(
                "improve_fraction, change_fraction, reflow_fraction, move_cost_fraction and split_min_gain "
                "must be >= 0, "
                "and slow_flow_give in [0, 1)"
            )
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
    quant: str = setting(
        "none",
        "hold the layers' projection weights quantized through bitsandbytes: int8 (LLM.int8()) or nf4"
        " (4-bit, ~1/4 of float16's memory); none keeps them as loaded",
        choices=QUANT_KINDS,
    )
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "port to listen on (0: any free)")
    listen: bool = setting(
        True,
        "TEST ONLY: listen on no address, so no one can dial us (a NAT without inbound)",
        flag="--no-listen",
    )
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
    traffic_file: str | None = setting(
        None, "write our background traffic by cause (JSON) here every few seconds", metavar="FILE"
    )
    record_ttl_s: float = setting(
        DirectoryConfig.ttl_s, "our DHT record expires this long after we stop refreshing it"
    )
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
    watch: WatchConfig = component(WatchConfig, prefix="watch")
    follow: FollowConfig = component(FollowConfig, prefix="follow")
    election: ElectionConfig = component(ElectionConfig, prefix="planner")
    planner: PlannerConfig = component(PlannerConfig, prefix="planner")

    def __post_init__(self) -> None:
        if self.layers != "auto":
            LayerRange.parse(self.layers)  # raises ValueError with a clear message
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"unknown device {self.device!r}: use cpu, cuda or cuda:N")
        if self.quant not in QUANT_KINDS:
            raise ValueError(f"unknown quant {self.quant!r}: use one of {', '.join(QUANT_KINDS)}")
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
