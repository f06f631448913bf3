"""The client's configuration: one frozen dataclass, every field with its default and its help, units in the names.

Programs that take the client's settings on their command line (swarm-chat) build the options from these fields
(swarm.settings), so each setting has one default."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.codec import ActivationConfig
from swarm.dht.trust import MAX_LAYER_TOKENS_S, MIN_REPORTERS
from swarm.settings import component, setting
from swarm.types import DTYPE_BYTES, QUANT_KINDS

SPECULATE_CHOICES = ("off", "lookup", "model", "self")


@dataclass(frozen=True)
class ClientConfig:
    """How a SwarmClient finds the swarm, which model it expects and how hard it tries before giving up."""

    initial_peers: tuple[str, ...] = setting(
        (), "multiaddrs of peers already in the swarm (at least one)", flag="--initial-peers", metavar="MADDR"
    )
    model: str = setting(
        "default", "model name or path; its weights hash must match the swarm's", flag="--model"
    )
    device: str = setting("cpu", "torch device of the local embeddings and LM head")
    dtype: str = setting(
        "float32", "torch dtype of the local embeddings and LM head (float32, bfloat16, float16)"
    )
    connect_timeout_s: float = setting(
        30.0, "how long to wait for the DHT to show peers covering every layer before NoRouteError"
    )
    step_timeout_s: float = setting(
        30.0, "deadline of one forward step through the whole route (prefill or one decode token)"
    )
    close_timeout_s: float = setting(
        5.0, "deadline for telling peers to drop a finished session (failures are logged)"
    )
    max_retries: int = setting(
        4, "failovers per step (ban, re-route, replay) before the error reaches the caller"
    )
    retry_delay_s: float = setting(
        0.2, "pause before a retry after a transport error, doubled each time (the DHT notices meanwhile)"
    )
    # A banned peer is routed through only where nobody else holds its layers.
    ban_initial_s: float = setting(
        15.0, "how long a failing peer is deprioritised the first time (doubles on repeats)"
    )
    ban_max_s: float = setting(300.0, "upper bound of a peer's ban")
    # A holder restarting or moving, or a late join, may leave layers unserved for a while.
    route_wait_s: float = setting(
        60.0, "how long a session waits for a peer to serve layers nobody serves now (0: fail at once)"
    )
    route_poll_s: float = setting(0.5, "while waiting for a route, the swarm is re-read this often")
    # The probe is a short info call to each peer of the route (client/liveness.py).
    probe_after_s: float = setting(
        1.0, "a step outstanding this long (or probe_factor x its expected time, if longer) probes the route"
    )
    probe_factor: float = setting(4.0, "how many times its expected duration a step may run before a probe")
    probe_timeout_s: float = setting(
        1.0, "a peer silent to a probe this long is taken for dead: failover at once"
    )
    cache_high_water: float = setting(
        0.9, "peers whose KV cache is fuller than this fraction get no new session"
    )
    snapshot_max_age_s: float = setting(2.0, "a DHT snapshot younger than this is reused instead of re-read")
    min_reporters: int = setting(
        MIN_REPORTERS,
        "never route through a peer reported for wrong outputs by this many distinct reporters (0: never)",
    )
    max_layer_tokens_s: float = setting(
        MAX_LAYER_TOKENS_S,
        "announced decode tokens/s per layer above this count as this (cap on what peers claim)",
    )
    # A check re-runs one stage on another peer holding its layers and compares (client/spot.py has its cost:
    # a liar is dropped after a few dozen steps of a client).
    spot_check_rate: float = setting(0.02, "fraction of steps spot-checked on another peer (0: no checks)")
    # False: the check runs beside the session's next steps (one at a time per session), costing the user
    # nothing but the peers' time; a liar it finds is dropped from the step after the check ends. True: a liar
    # is caught before the checked step's output is used (tests of exact outputs with a lying peer, at rate
    # 1.0); each check then stalls the stream.
    spot_check_blocking: bool = setting(False, "a sampled step waits for its check")
    # A check is 2 prefills of this many tokens per hop and one more, so its cost does not grow with the
    # session; a longer window catches no more liars (a corrupted output is off at every token of it). Two
    # tokens still run every weight of a layer: the second token's attention weighs two keys, so q and k count.
    # While others decode on a peer, the check rides in their next forward call (ExecutorConfig.
    # ride_along_tokens) and makes it longer. Measurements: docs/benchmarks.md.
    spot_check_tokens: int = setting(2, "how many of the session's newest tokens one spot-check re-runs")
    spot_check_seed: int | None = setting(
        None, "seed of the draw of which steps are checked (default: unpredictable, as against real liars)"
    )
    # Peers holding their layers quantized (swarm-peer --quant) compute other numbers, honestly: a route goes
    # through peers of one kind only, so outputs are those of one model, and spot-checks compare like with like.
    quant: str = setting(
        "none",
        "the --quant of the peers this client's routes go through: none, int8 or nf4",
        choices=QUANT_KINDS,
    )
    # A step carries the drafter's guesses and keeps those the model agrees with (client.drafting): greedy
    # tokens are those of plain decoding, sampled ones drawn as plain sampling draws them, in fewer trips where
    # the guesses are right. Each session drafts only while it pays (client.drafting.DraftLength).
    # "model" and "self" run a model on the client (client.draft_model): draft_model, or the served model's
    # first draft_layers layers under the client's own head.
    speculate: str = setting(
        "lookup",
        "draft tokens to verify in one step: off, lookup (n-grams of the prompt and answer so far), model "
        "(the model draft_model names) or self (the served model's first draft_layers layers)",
        choices=SPECULATE_CHOICES,
    )
    draft_tokens: int = setting(4, "most drafted tokens one speculative step carries")
    draft_model: str = setting(
        "", "the drafter of speculate=model: a model name or path as --model takes, sharing its tokenizer"
    )
    draft_layers: int = setting(0, "layers of the served model that speculate=self drafts with")
    draft_cache_tokens: int = setting(
        8192, "KV cache of a model drafter's layers, shared by the sessions (past it, no drafts)"
    )
    # The chunks go all at once, so the route's peers compute different chunks at the same time.
    prefill_chunk_tokens: int = setting(
        256,
        "a longer prompt is sent as chunks of about this many tokens, pipelined along the route (0: whole)",
    )
    # Each group sends its decode steps together as one batch per round (client.batching). With one group a
    # round passes the stages one after another and one works at a time; with two, one group's steps are on
    # one peer while the other's are on the next one or in this client's head. Measurements: docs/benchmarks.md.
    batch_lanes: int = setting(2, "groups a client's concurrent generations are dealt into")
    # True: a round's decode steps to a route's first hop go as one message (StepBatch), its waits at the last
    # hop as one (StepWaits). False sends a request and a reply per session each: the behaviour before, kept to
    # compare the two on one swarm.
    group_messages: bool = setting(
        True,
        "send each session's decode step and its wait alone, not a round's as one message each way",
        flag="no-group-messages",
    )
    # So the group the peers wait for holds only steps that come; one held up longer sends its step alone.
    round_settle_s: float = setting(
        0.02,
        "how long a round's decode steps wait for the round's other sessions to decide whether they go on",
    )
    # True: connecting freezes the objects loading made out of full garbage collections, process-wide. A full
    # collection over the objects loading made (torch, transformers, the head) holds every token of the
    # process for a noticeable pause. Turn it off in a process that makes and drops many clients: frozen objects
    # that later end up in reference cycles are never collected.
    freeze_heap: bool = setting(
        True,
        "do not freeze what loading made out of full garbage collections on connecting (swarm.models.heap)",
        flag="no-freeze-heap",
    )
    # The hops to the route's first peer and back from its last one; the peers choose for the hops between
    # them (their own --activations).
    activations: ActivationConfig = component(ActivationConfig, prefix="activations")

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
        if self.speculate not in SPECULATE_CHOICES:
            raise ValueError(
                f"ClientConfig.speculate must be one of {', '.join(SPECULATE_CHOICES)}, got {self.speculate!r}"
            )
        if self.draft_tokens < 1:
            raise ValueError(f"ClientConfig.draft_tokens must be >= 1, got {self.draft_tokens}")
        if self.speculate == "model" and not self.draft_model:
            raise ValueError("ClientConfig.speculate='model' needs draft_model (a model name or path)")
        if self.draft_layers < 0 or (self.speculate == "self" and self.draft_layers < 1):
            raise ValueError(
                f"ClientConfig.speculate='self' needs draft_layers >= 1, got {self.draft_layers}"
            )
        if self.draft_cache_tokens < 1:
            raise ValueError(f"ClientConfig.draft_cache_tokens must be >= 1, got {self.draft_cache_tokens}")
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
