"""The web server's configuration: one frozen dataclass, and the `swarm-chat` command line built from it.

Each setting is written once, as a field with its default and help (swarm.settings); `build_parser` turns every
field into a `--flag-with-dashes`, so a new limit needs no second edit to reach the CLI. The client's settings
(client.config.ClientConfig) come in as a component: `--initial-peers`, `--model` and `--client-<name>`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields

from client.config import ClientConfig
from swarm.settings import add_arguments, component, from_arguments, positive, setting


@dataclass(frozen=True)
class WebConfig:
    """How `swarm-chat` reaches the swarm, where it listens and the limits that keep a public server up."""

    host: str = setting(
        "127.0.0.1", "address to listen on; 127.0.0.1 keeps the server private to this machine"
    )
    port: int = setting(8000, "TCP port to listen on (0 picks a free one and prints it)")
    max_concurrent_generations: int = setting(4, "generations running on the swarm at once")
    max_queued_generations: int = setting(16, "generations waiting for a slot; past this, 429")
    rate_limit_per_min: float = setting(60.0, "requests per minute allowed from one client address")
    rate_limit_burst: int = setting(
        20, "requests one client address may send at once before the rate applies"
    )
    max_tokens_limit: int = setting(1024, "largest max_tokens a request may ask for; larger is a 400")
    default_max_tokens: int = setting(256, "max_tokens of a request that does not say")
    context_tokens: int = setting(
        2048, "longest prompt + max_tokens a request may ask for (each peer reserves that much KV cache)"
    )
    max_body_bytes: int = setting(1 << 20, "largest request body in bytes; larger is a 413")
    request_timeout_s: float = setting(300.0, "deadline of one request, queueing included")
    status_timeout_s: float = setting(
        3.0, "deadline of the status page's directory read and live peer queries"
    )
    recent_requests: int = setting(20, "how many recent requests (with their routes) the status page lists")
    # The client's own settings, each with its one default: --initial-peers and --model as they are, the rest
    # as --client-<name> (--client-step-timeout-s, --client-connect-timeout-s, ...).
    client: ClientConfig = component(ClientConfig, prefix="client")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        positive(self, *(f.name for f in fields(self) if f.type in ("int", "float") and f.name != "port"))
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")


def build_parser() -> argparse.ArgumentParser:
    """`swarm-chat`'s arguments: one flag per WebConfig field, with the field's default and help."""
    parser = argparse.ArgumentParser(
        prog="swarm-chat",
        description="Web chat, OpenAI-compatible API, status page and /metrics for a FlowSwarm swarm.",
    )
    add_arguments(parser, WebConfig)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> WebConfig:
    """A WebConfig from command-line arguments; invalid values exit with argparse's usage message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.client_initial_peers:
        parser.error("the following arguments are required: --initial-peers")
    try:
        return from_arguments(WebConfig, args)
    except ValueError as error:
        parser.error(str(error))
