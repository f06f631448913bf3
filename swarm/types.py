"""The shared vocabulary: ids, half-open layer ranges, plans.

Everything here is plain data with no I/O, importable from every layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NewType

SessionID = NewType("SessionID", str)  # client-chosen random hex id of an inference session
NodeID = NewType("NodeID", str)  # a planner graph node: a peer id live, any string offline

SOURCE: NodeID = NodeID("source")  # the client side that embeds tokens
SINK: NodeID = NodeID("sink")  # the client side that runs the LM head


@dataclass(frozen=True, order=True)
class LayerRange:
    """Transformer layers [start, end), half-open like Python slices."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"invalid layer range [{self.start}, {self.end}): need 0 <= start < end")

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    def covers(self, other: LayerRange) -> bool:
        return self.start <= other.start and other.end <= self.end

    def intersect(self, other: LayerRange) -> LayerRange | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return LayerRange(start, end) if start < end else None

    def check_within(self, num_layers: int) -> None:
        if self.end > num_layers:
            raise ValueError(f"layer range {self} is past the last layer: the model has {num_layers} layers")

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse "A:B" as [A, B)."""
        try:
            start_s, end_s = text.split(":")
            return cls(int(start_s), int(end_s))
        except ValueError as e:
            raise ValueError(f"bad layer range {text!r}: expected START:END with 0 <= START < END") from e

    def to_list(self) -> list[int]:
        return [self.start, self.end]


def coverage(ranges: Iterable[LayerRange], num_layers: int) -> list[int]:
    """How many of `ranges` hold each layer of [0, num_layers); parts past the last layer are ignored."""
    # Difference array: +1 where a range starts, -1 where it ends, then a running sum.
    steps = [0] * (num_layers + 1)
    for r in ranges:
        if r.start < num_layers:
            steps[r.start] += 1
            steps[min(r.end, num_layers)] -= 1
    return list(itertools.accumulate(steps[:num_layers]))


@dataclass(frozen=True)
class EdgeFlow:
    """Tokens/s that a max-flow solution sends along one directed edge of the placement graph."""

    src: NodeID
    dst: NodeID
    tokens_s: float


@dataclass(frozen=True)
class Plan:
    """A layer placement with its max-flow edge flows: what the planner publishes and routing reads."""

    method: str
    placement: dict[NodeID, LayerRange]
    max_flow_tokens_s: float
    flows: tuple[EdgeFlow, ...] = ()
    upper_bound_tokens_s: float = 0.0
    solve_s: float = 0.0
    epoch: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # Prefill and decode planned as two flows over one placement: ``flows`` then carry prompt tokens and these
    # the decode tokens. Empty: ``flows`` serve both phases (a plan where splitting does not pay).
    decode_flows: tuple[EdgeFlow, ...] = ()

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {
            "method": self.method,
            "epoch": self.epoch,
            "placement": {str(n): r.to_list() for n, r in self.placement.items()},
            "max_flow_tokens_s": self.max_flow_tokens_s,
            "upper_bound_tokens_s": self.upper_bound_tokens_s,
            "flows": [{"src": f.src, "dst": f.dst, "tokens_s": f.tokens_s} for f in self.flows],
            "solve_s": self.solve_s,
        }
        if self.decode_flows:  # left out otherwise, so a plan of one flow keeps its old bytes
            body["decode_flows"] = [
                {"src": f.src, "dst": f.dst, "tokens_s": f.tokens_s} for f in self.decode_flows
            ]
        return body

    @classmethod
    def from_json(cls, data: dict) -> Plan:  # type: ignore[type-arg]
        return cls(
            method=str(data.get("method", "unknown")),
            epoch=int(data.get("epoch", 0)),
            placement={NodeID(n): LayerRange(int(r[0]), int(r[1])) for n, r in data["placement"].items()},
            max_flow_tokens_s=float(data.get("max_flow_tokens_s", 0.0)),
            upper_bound_tokens_s=float(data.get("upper_bound_tokens_s", 0.0)),
            flows=tuple(
                EdgeFlow(NodeID(f["src"]), NodeID(f["dst"]), float(f["tokens_s"]))
                for f in data.get("flows", [])
            ),
            solve_s=float(data.get("solve_s", 0.0)),
            decode_flows=tuple(
                EdgeFlow(NodeID(f["src"]), NodeID(f["dst"]), float(f["tokens_s"]))
                for f in data.get("decode_flows", [])
            ),
        )


# The dtypes FlowSwarm runs and sends, with their size: the one table every layer derives its own view from.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

# How a peer may hold its layers' projection weights: as loaded (none), or quantized through bitsandbytes
# (int8: LLM.int8(); nf4: 4-bit NormalFloat with double-quantized block scales). swarm/models/quant.py.
QUANT_KINDS: tuple[str, ...] = ("none", "int8", "nf4")

# The DHT's layout, which the paper model of background traffic (swarm/sim/background.py) shares with the DHT
# code (swarm/dht/schemas.py): peer records spread over PEER_SHARDS keys, and the planner's summary written
# under one key per READERS_PER_SUMMARY_COPY peers, at most MAX_SUMMARY_COPIES.
PEER_SHARDS = 24
MAX_SUMMARY_COPIES = 128
READERS_PER_SUMMARY_COPY = 100


def summary_copies(peer_count: int) -> int:
    """Keys the planner writes its summary under for a swarm of ``peer_count``: one per
    READERS_PER_SUMMARY_COPY peers, so the nodes storing one answer at most about that many readers."""
    return max(1, min(MAX_SUMMARY_COPIES, -(-peer_count // READERS_PER_SUMMARY_COPY)))
