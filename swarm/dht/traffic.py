"""A peer's background traffic by cause: the payload bytes of what it writes to and reads from the DHT, and of
its link probes. Payloads only: the DHT's own framing, its copies to several nodes and its routing upkeep are
not seen here (scripts/bench_dht.py measures what crosses the network interface)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

# The causes, in the order status shows them.
CAUSES = (
    "announce",  # our peer record stored (refresh, change, withdrawal)
    "summary",  # the small summary key: read often, written by the planner
    "peer_reads",  # full reads of the peer records
    "plan",  # plan reads and writes
    "lease",  # planner-lease reads and writes
    "reports",  # misbehaviour reports read and written
    "link_probes",  # RTT pings and bandwidth probes to other peers
)


def payload_bytes(value: Any) -> int:
    """Bytes of ``value`` as msgpack (what a DHT value costs on the wire, once, before framing)."""
    try:
        return len(msgpack.packb(value, use_bin_type=True))
    except (TypeError, ValueError):
        return 0


def read_bytes(raw: Mapping[Any, tuple[Any, float]]) -> int:
    """Bytes of a dictionary read (subkeys with their values)."""
    return sum(len(subkey) + payload_bytes(value) for subkey, (value, _expiration) in raw.items())


class TrafficMeter:
    """Bytes sent and received so far, by cause (see CAUSES)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = dict.fromkeys(CAUSES, 0)
        self.received: dict[str, int] = dict.fromkeys(CAUSES, 0)

    def add(self, cause: str, sent: int = 0, received: int = 0) -> None:
        if cause not in self.sent:
            raise ValueError(f"unknown traffic cause {cause!r}")
        self.sent[cause] += sent
        self.received[cause] += received

    def triples(self) -> tuple[tuple[str, int, int], ...]:
        """(cause, sent, received) for each cause, as InfoReply carries them."""
        return tuple((cause, self.sent[cause], self.received[cause]) for cause in CAUSES)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{cause: {"sent": bytes, "received": bytes}}"""
        return {cause: {"sent": self.sent[cause], "received": self.received[cause]} for cause in CAUSES}
