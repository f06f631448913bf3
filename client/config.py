"""The client's configuration: one frozen dataclass, every field documented, units in the names."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.types import DTYPE_BYTES


@dataclass(frozen=True)
class ClientConfig:
    """How a SwarmClient finds the swarm, which model it expects and how hard it tries before giving up."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the swarm (as printed by `swarm-peer join`); at least one is needed."""

    model: str = "default"
    """Model name or path given to swarm.models.resolve_model; its weights hash must match the swarm's."""

    device: str = "cpu"
    """Torch device of the local embeddings and LM head."""

    dtype: str = "float32"
    """Torch dtype name of the local embeddings and LM head (float32, bfloat16, float16)."""

    connect_timeout_s: float = 30.0
    """How long to wait for the DHT to show peers covering every layer before NoRouteError."""

    step_timeout_s: float = 30.0
    """Deadline of one forward step through the whole route (prefill or one decode token)."""

    close_timeout_s: float = 5.0
    """Deadline for telling peers to drop a finished session; failures here are only logged."""

    max_retries: int = 4
    """Failovers per step (ban, re-route, replay) before the error reaches the caller."""

    retry_delay_s: float = 0.2
    """Pause before a retry after a transport error, doubled each time (gives the DHT time to notice)."""

    ban_initial_s: float = 15.0
    """How long a failing peer is deprioritised the first time (routed through only where nobody else holds its
    layers); doubles on every repeat offence."""

    ban_max_s: float = 300.0
    """Upper bound of a peer's ban."""

    route_wait_s: float = 60.0
    """How long a session waits for some live peer to serve layers nobody serves now (a holder restarting or
    moving, a late join) before NoRouteError; 0 fails at once."""

    route_poll_s: float = 0.5
    """While waiting for a route, the swarm is re-read this often."""

    probe_after_s: float = 1.0
    """A step still outstanding after this long, or after `probe_factor` times the expected step time if that
    is longer, makes the client ask each peer of the route for a short info call (client/liveness.py)."""

    probe_factor: float = 4.0
    """How many times its expected duration a step may run before the route is probed."""

    probe_timeout_s: float = 1.0
    """A peer that does not answer a probe within this long is taken for dead: failover starts at once."""

    cache_high_water: float = 0.9
    """Peers whose KV cache is fuller than this fraction are skipped when routing a new session."""

    snapshot_max_age_s: float = 2.0
    """A DHT snapshot younger than this is reused instead of reading the DHT again."""

    min_reporters: int = 2
    """Never route through a peer reported for wrong outputs by this many distinct reporters (0: never)."""

    max_layer_tokens_s: float = 1e6
    """Announced decode tokens/s per layer above this count as this (plausibility cap on what peers claim)."""

    spot_check_rate: float = 0.02
    """Fraction of steps after which one stage is re-run on another peer holding its layers and compared, to
    catch peers that compute wrongly (0 turns spot-checks off). See client/spot.py for the cost: a check of a
    2-hop route costs ~5 decode steps of the peers' time, and a peer corrupting every output serves ~50 steps
    of a client (median 33) before that client drops it."""

    spot_check_blocking: bool = False
    """Whether a sampled step waits for its check. False: the check runs beside the session's next steps (one
    at a time per session), which then cost the user nothing but the peers' time, and a liar it finds is
    dropped from the step after the check ends. True: a liar is caught before the checked step's output is
    used (tests of exact outputs with a lying peer, at rate 1.0); each check then stalls the stream."""

    spot_check_tokens: int = 2
    """How many of the session's newest tokens one spot-check re-runs (its cost does not grow with the session).

    A check is 2 prefills of this many tokens per hop and one more (each stage alone, the route forwarded, one
    stage by another holder), so on a CPU it costs what the peers' products cost at that many rows. A longer
    window catches no more liars: a corrupted output is off at every token of it, and to a peer a check is a
    new session's first prefill whatever its length. Two tokens still run every weight of a layer: the second
    token's attention weighs two keys, so q and k count (with one token, attention would hand back v alone).
    While others decode on a peer, such a prefill rides in their next forward call (ExecutorConfig.
    ride_along_tokens), which it makes longer, so the window is what every check costs the decoding sessions.
    One client running 8 sessions (3 peers x 10 layers of the default model on 2 shared cores, checks at 0.02,
    8 alternated rounds): 145.7 tok/s with 2 tokens against 139.2 with 4 and 156.6 with no checks (medians);
    a 4-session decode call of 10 layers took 8.2 ms of CPU alone, 14-15 with 4 tokens riding. Before, 4
    replaced 8 (decode gaps p50 / p99 68-69 / 106-107 ms against 72-74 / 192-193), and 8 replaced 16 (a 16-row
    prefill left the 4-bit kernel for F.linear)."""

    spot_check_seed: int | None = None
    """Seed of the draw of which steps are checked (None: unpredictable, as it should be against real liars)."""

    prefill_chunk_tokens: int = 256
    """A longer prompt is sent as chunks of about this many tokens, all at once, so the route's peers compute
    different chunks at the same time (pipelined along the tokens); 0 sends it whole."""

    batch_lanes: int = 2
    """Groups a client's concurrent generations are dealt into, each sending its decode steps together as one
    batch per round (client.batching). One group gives the peers the largest batches, but a round then passes
    the route's stages one after another and only one of them works at a time; with two, one group's steps are
    on one peer while the other's are on the next one or in this client's head. On 2 shared cores, 3 peers x 10
    layers of the default model (4-bit kernel), one client running 8 sessions: 44.8 against 37.0 tok/s with 1
    lane (medians of 4 alternated rounds, 2 lanes ahead in each), and 2 lanes 50.5 against 44.8 with 3 and 47.3
    with 4 (3 rounds). Before the 4-bit kernel, when a forward call cost twice as much, 2 lanes measured no gain:
    the cores were the limit, and smaller batches cost more per token."""

    group_messages: bool = True
    """A round's decode steps to a route's first hop go as one message (StepBatch), and its waits for their
    outputs at the last hop as one (StepWaits), instead of a request and a reply per session each
    (client.grouping). False sends each alone: the behaviour before, kept to compare the two on one swarm."""

    round_settle_s: float = 0.02
    """How long the decode steps of one round of concurrent generations wait for the round's other sessions to
    decide whether they go on (client.batching.Round), so the group the peers wait for holds only steps that
    come. Sessions normally decide at once; one held up longer sends its step alone."""

    freeze_heap: bool = True
    """Whether connecting freezes the objects loading made (torch, transformers, the head) out of full garbage
    collections, process-wide (swarm.models.heap): a full collection over them holds every token of the process
    for 0.3-1 s. Turn it off in a process that makes and drops many clients: frozen objects that later end up in
    reference cycles are never collected."""

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, str):
            raise ValueError("initial_peers must be a list of multiaddrs, not one string")
        positive = ("connect_timeout_s", "step_timeout_s", "close_timeout_s", "ban_initial_s", "ban_max_s")
        for name in (*positive, "route_poll_s", "probe_after_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ClientConfig.{name} must be positive, got {getattr(self, name)}")
        if self.min_reporters < 0:
            raise ValueError(f"ClientConfig.min_reporters must be >= 0, got {self.min_reporters}")
        if self.max_layer_tokens_s <= 0:
            raise ValueError(
                f"ClientConfig.max_layer_tokens_s must be positive, got {self.max_layer_tokens_s}"
            )
        for name in ("route_wait_s", "round_settle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ClientConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.probe_factor < 1:
            raise ValueError(f"ClientConfig.probe_factor must be >= 1, got {self.probe_factor}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"ClientConfig.prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}"
            )
        if self.batch_lanes < 1:
            raise ValueError(f"ClientConfig.batch_lanes must be >= 1, got {self.batch_lanes}")
        if self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries must be >= 0, got {self.max_retries}")
        if not 0.0 < self.cache_high_water <= 1.0:
            raise ValueError(f"ClientConfig.cache_high_water must be in (0, 1], got {self.cache_high_water}")
        if not 0.0 <= self.spot_check_rate <= 1.0:
            raise ValueError(f"ClientConfig.spot_check_rate must be in [0, 1], got {self.spot_check_rate}")
        if self.spot_check_tokens < 1:
            raise ValueError(f"ClientConfig.spot_check_tokens must be >= 1, got {self.spot_check_tokens}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"ClientConfig.dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}"
            )
