"""Prometheus metrics of the web face, in a registry of their own (two servers in one process stay apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: a token through a CPU swarm takes ~0.1 s, a first token (queue + prefill) up to tens of seconds.
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 10.0)


class WebMetrics:
    """Everything /metrics reports; names are prefixed `flowswarm_`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "flowswarm_http_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.tokens = Counter("flowswarm_tokens_generated", "tokens generated for clients", registry=r)
        self.ttft = Histogram(
            "flowswarm_time_to_first_token_seconds",
            "request arrival to first token",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.token_latency = Histogram(
            "flowswarm_token_latency_seconds",
            "time between consecutive tokens",
            buckets=TOKEN_BUCKETS_S,
            registry=r,
        )
        self.active = Gauge("flowswarm_active_generations", "generations running on the swarm", registry=r)
        self.queued = Gauge("flowswarm_queued_generations", "generations waiting for a slot", registry=r)
        self.peers = Gauge(
            "flowswarm_peers_seen", "peers in the latest directory snapshot, by state", ["state"], registry=r
        )
        self.failovers = Counter(
            "flowswarm_failovers", "steps retried on a new route or replayed", registry=r
        )
        self.cancelled = Counter(
            "flowswarm_generations_cancelled", "generations stopped by their client", registry=r
        )
        self.background = Gauge(
            "flowswarm_peer_background_bytes",
            "a serving peer's background traffic so far (payload bytes), by cause and direction",
            ["peer", "cause", "direction"],
            registry=r,
        )
        self.kv_blocks = Gauge(
            "flowswarm_peer_kv_blocks",
            "a serving peer's KV cache blocks now: used (shared among them) and free",
            ["peer", "kind"],
            registry=r,
        )
        self.prefix_tokens = Gauge(
            "flowswarm_peer_prefix_tokens",
            "a serving peer's prompt tokens looked for among shared prefix blocks, and found, so far",
            ["peer", "kind"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "flowswarm_peer_prefix_hit_rate",
            "a serving peer's prompt tokens found among shared prefix blocks over those looked for, so far",
            ["peer"],
            registry=r,
        )
        self.errors = Counter(
            "flowswarm_errors", "errors sent to clients, by type and code", ["type", "code"], registry=r
        )
        # speculative decoding (client.drafting): acceptance = accepted / drafted
        self.drafted = Counter("flowswarm_draft_tokens", "drafted tokens sent to be verified", registry=r)
        self.accepted = Counter(
            "flowswarm_draft_accepted_tokens", "drafted tokens the model kept", registry=r
        )
        self.draft_steps = Counter("flowswarm_draft_steps", "steps that carried drafts", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
