"""The planner's input: a snapshot of the swarm as plain data (model, nodes, directed links).

Live, swarm/dht builds a Cluster from the peers' announced records; offline, it is read from CLUSTER.json:

    {"model": {"name", "num_layers", "activation_bytes_per_token", "token_id_bytes"},
     "nodes": [{"id", "region", "max_layers", "tokens_s_by_layers": [...], ...extra fields}],
     "links": [{"src", "dst", "bandwidth_bytes_s", "latency_s"}]}

Links are directed; "source" and "sink" name the client side (embeddings, LM head). Two nodes with no link
between them are unconnected: the planner never sends tokens between them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from swarm.types import SINK, SOURCE, NodeID

_NODE_KEYS = ("id", "region", "max_layers", "tokens_s_by_layers")


@dataclass(frozen=True)
class ModelInfo:
    """What the planner needs to know about the served model."""

    name: str
    num_layers: int
    activation_bytes_per_token: int  # one hidden state on the wire (hidden_size * dtype bytes)
    token_id_bytes: int = 4  # what the client sends to the first peer per token

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"model {self.name!r}: num_layers must be >= 1, got {self.num_layers}")
        if self.activation_bytes_per_token <= 0 or self.token_id_bytes <= 0:
            raise ValueError(
                f"model {self.name!r}: activation_bytes_per_token and token_id_bytes must be > 0"
            )


@dataclass(frozen=True)
class ClusterNode:
    """One peer as the planner sees it.

    tokens_s_by_layers[k-1] is the node's throughput in tokens/s when it holds k layers and runs all of them
    on every token; its length bounds max_layers (memory decides max_layers, measurement fills the table).
    """

    id: NodeID
    region: str
    max_layers: int
    tokens_s_by_layers: tuple[float, ...]
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.id in (SOURCE, SINK):
            raise ValueError(f"node id {self.id!r} is reserved for the client side")
        if self.max_layers < 0:
            raise ValueError(f"node {self.id}: max_layers must be >= 0, got {self.max_layers}")
        if len(self.tokens_s_by_layers) < self.max_layers:
            raise ValueError(
                f"node {self.id}: tokens_s_by_layers has {len(self.tokens_s_by_layers)} entries "
                f"but max_layers is {self.max_layers}"
            )
        if any(not (t >= 0.0) for t in self.tokens_s_by_layers[: self.max_layers]):
            raise ValueError(f"node {self.id}: tokens_s_by_layers must be >= 0")

    def tokens_s(self, num_layers: int) -> float:
        """Throughput holding `num_layers` layers (0 for an idle node)."""
        if num_layers <= 0:
            return 0.0
        if num_layers > self.max_layers:
            raise ValueError(f"node {self.id} holds at most {self.max_layers} layers, asked for {num_layers}")
        return self.tokens_s_by_layers[num_layers - 1]


@dataclass(frozen=True)
class ClusterLink:
    """A directed network link; tokens sent src -> dst pay its bandwidth."""

    src: NodeID
    dst: NodeID
    bandwidth_bytes_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.src == self.dst:
            raise ValueError(f"link from {self.src} to itself")
        if not (self.bandwidth_bytes_s >= 0.0) or not (self.latency_s >= 0.0):
            raise ValueError(f"link {self.src}->{self.dst}: bandwidth and latency must be >= 0")


@dataclass(frozen=True)
class Cluster:
    """Model + nodes + directed links. Immutable; derived lookups are cached."""

    model: ModelInfo
    nodes: tuple[ClusterNode, ...]
    links: tuple[ClusterLink, ...] = ()

    def __post_init__(self) -> None:
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate node ids: {dup}")
        known = set(ids) | {SOURCE, SINK}
        for link in self.links:
            if link.src not in known or link.dst not in known:
                raise ValueError(f"link {link.src}->{link.dst} names an unknown node")
            if link.src == SINK or link.dst == SOURCE:
                raise ValueError(f"link {link.src}->{link.dst}: tokens flow source -> nodes -> sink only")

    @cached_property
    def node_by_id(self) -> dict[NodeID, ClusterNode]:
        return {n.id: n for n in self.nodes}

    @cached_property
    def link_by_pair(self) -> dict[tuple[NodeID, NodeID], ClusterLink]:
        # A later duplicate overrides an earlier one, so callers can append corrections.
        return {(link.src, link.dst): link for link in self.links}

    @cached_property
    def regions(self) -> tuple[str, ...]:
        return tuple(sorted({n.region for n in self.nodes}))

    def bandwidth_bytes_s(self, src: NodeID, dst: NodeID) -> float:
        """Bandwidth of the link src -> dst, 0 when there is none."""
        link = self.link_by_pair.get((src, dst))
        return link.bandwidth_bytes_s if link is not None else 0.0

    def layer_cap(self, node: ClusterNode) -> int:
        """Most layers the node may hold for this model."""
        return min(node.max_layers, self.model.num_layers)

    def with_links(self, links: tuple[ClusterLink, ...]) -> Cluster:
        return Cluster(self.model, self.nodes, links)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cluster:
        try:
            m = data["model"]
            model = ModelInfo(
                name=str(m["name"]),
                num_layers=int(m["num_layers"]),
                activation_bytes_per_token=int(m["activation_bytes_per_token"]),
                token_id_bytes=int(m.get("token_id_bytes", 4)),
            )
            nodes = tuple(
                ClusterNode(
                    id=NodeID(str(n["id"])),
                    region=str(n.get("region", "default")),
                    max_layers=int(n["max_layers"]),
                    tokens_s_by_layers=tuple(float(t) for t in n["tokens_s_by_layers"]),
                    extra={k: v for k, v in n.items() if k not in _NODE_KEYS},
                )
                for n in data["nodes"]
            )
            links = tuple(
                ClusterLink(
                    src=NodeID(str(lk["src"])),
                    dst=NodeID(str(lk["dst"])),
                    bandwidth_bytes_s=float(lk["bandwidth_bytes_s"]),
                    latency_s=float(lk.get("latency_s", 0.0)),
                )
                for lk in data.get("links", [])
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad cluster description: missing or malformed field {e}") from e
        return cls(model, nodes, links)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {
                "name": self.model.name,
                "num_layers": self.model.num_layers,
                "activation_bytes_per_token": self.model.activation_bytes_per_token,
                "token_id_bytes": self.model.token_id_bytes,
            },
            "nodes": [
                {
                    "id": n.id,
                    "region": n.region,
                    "max_layers": n.max_layers,
                    "tokens_s_by_layers": list(n.tokens_s_by_layers),
                    **n.extra,
                }
                for n in self.nodes
            ],
            "links": [
                {
                    "src": lk.src,
                    "dst": lk.dst,
                    "bandwidth_bytes_s": lk.bandwidth_bytes_s,
                    "latency_s": lk.latency_s,
                }
                for lk in self.links
            ],
        }


def load_cluster(path: str | Path) -> Cluster:
    """Read CLUSTER.json (format in the module docstring)."""
    with open(path) as f:
        return Cluster.from_json(json.load(f))


def full_mesh_links(
    nodes: tuple[ClusterNode, ...] | list[ClusterNode],
    bandwidth_bytes_s: float = 1.25e9,
    latency_s: float = 0.001,
    client_bandwidth_bytes_s: float | None = None,
) -> tuple[ClusterLink, ...]:
    """Links in both directions between every pair of nodes, plus source -> node and node -> sink.

    For tests and hand-made clusters; real clusters come with measured links.
    """
    client_bw = bandwidth_bytes_s if client_bandwidth_bytes_s is None else client_bandwidth_bytes_s
    links: list[ClusterLink] = []
    for a in nodes:
        links.append(ClusterLink(SOURCE, a.id, client_bw, latency_s))
        links.append(ClusterLink(a.id, SINK, client_bw, latency_s))
        for b in nodes:
            if a.id != b.id:
                links.append(ClusterLink(a.id, b.id, bandwidth_bytes_s, latency_s))
    return tuple(links)


def with_full_mesh(cluster: Cluster, bandwidth_bytes_s: float = 1.25e9, latency_s: float = 0.001) -> Cluster:
    """The cluster with a uniform full mesh added wherever it has no link yet (existing links win)."""
    mesh = full_mesh_links(cluster.nodes, bandwidth_bytes_s, latency_s)
    have = set(cluster.link_by_pair)
    return cluster.with_links(cluster.links + tuple(lk for lk in mesh if (lk.src, lk.dst) not in have))
