"""The status document behind /status and /api/status: peers, coverage, planner, plan and its flows.

Built from the swarm directory's latest snapshot (what every peer announced) and, where a peer answered
`rpc_info` just now, its live free KV cache, blocks and active sessions, which records only refresh every ~10 s.
Pure: the server reads the snapshot and the live answers; this module only shapes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarm.dht import PeerRecord, SwarmSnapshot, coverage
from swarm.errors import SwarmError
from swarm.transport import call_info
from swarm.types import SINK, SOURCE
from swarm.wire import CacheStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveInfo:
    """What a peer said about itself in answer to rpc_info."""

    free_cache_tokens: int
    active_sessions: int
    state: str
    background_bytes: tuple[tuple[str, int, int], ...] = ()  # (cause, sent, received) so far
    cache: CacheStats | None = None  # its KV blocks and prefix sharing


def cache_json(stats: CacheStats | None) -> dict[str, Any] | None:
    """A peer's KV blocks (used, of them shared, free) and prefix hit rate, from InfoReply.cache."""
    if stats is None:
        return None
    return {**asdict(stats), "prefix_hit_rate": round(stats.prefix_hit_rate, 4)}


def background_json(triples: Iterable[tuple[str, int, int]]) -> dict[str, dict[str, int]]:
    """{cause: {"sent": bytes, "received": bytes}} from InfoReply.background_bytes."""
    return {cause: {"sent": sent, "received": received} for cause, sent, received in triples}


def _peer_json(record: PeerRecord, live: LiveInfo | None) -> dict[str, Any]:
    return {
        "peer_id": record.peer_id,
        "name": record.name,
        "state": live.state if live else record.state,
        "range": [record.range_start, record.range_end],
        "older_ranges": [[o.start, o.end, o.sessions] for o in record.older_ranges],  # [start, end, sessions]
        "device": record.device,
        "decode_tokens_s": record.decode_layer_tokens_s_b1,
        "decode_tokens_s_b8": record.decode_layer_tokens_s_b8,
        "prefill_tokens_s": record.prefill_layer_tokens_s,
        "cache_tokens_total": record.cache_tokens_total,
        "free_cache_tokens": live.free_cache_tokens if live else record.free_cache_tokens,
        "active_sessions": live.active_sessions if live else record.active_sessions,
        "live": live is not None,
        "background_bytes": background_json(live.background_bytes) if live else {},
        "kv_cache": cache_json(live.cache) if live else None,
        "updated_at": record.updated_at,
    }


def _plan_json(snapshot: SwarmSnapshot, names: Mapping[str, str]) -> dict[str, Any] | None:
    if snapshot.plan is None:
        return None
    body = snapshot.plan.plan

    def label(node: str) -> str:
        ends: dict[str, str] = {SOURCE: "client (embed)", SINK: "client (LM head)"}
        return ends.get(node, names.get(node, node[-8:]))

    flows = [
        {
            "src": f["src"],
            "dst": f["dst"],
            "src_name": label(f["src"]),
            "dst_name": label(f["dst"]),
            "tokens_s": float(f["tokens_s"]),
        }
        for f in body.get("flows", [])
        if isinstance(f, dict) and {"src", "dst", "tokens_s"} <= f.keys()
    ]
    return {
        "epoch": snapshot.plan.epoch,
        "method": body.get("method"),
        "planner": snapshot.plan.planner_peer_id,
        "created_at": snapshot.plan.created_at,
        "max_flow_tokens_s": body.get("max_flow_tokens_s"),
        "upper_bound_tokens_s": body.get("upper_bound_tokens_s"),
        "placement": body.get("placement", {}),
        "flows": flows,
    }


def status_json(
    snapshot: SwarmSnapshot,
    num_layers: int,
    model: str,
    live: Mapping[str, LiveInfo],
    recent: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The /api/status document."""
    names = {pid: r.name for pid, r in snapshot.peers.items()}
    records = sorted(snapshot.peers.values(), key=lambda r: (r.range_start, r.range_end, r.name))
    counts = coverage(snapshot, num_layers)
    planner = snapshot.planner_peer_id
    return {
        "model": model,
        "num_layers": num_layers,
        "fetched_at": snapshot.fetched_at,
        "peers": [_peer_json(r, live.get(r.peer_id)) for r in records],
        "coverage": counts,
        "missing_layers": [layer for layer, n in enumerate(counts) if n == 0],
        "planner": {"peer_id": planner, "name": names.get(planner, planner)} if planner else None,
        "plan": _plan_json(snapshot, names),
        "recent_requests": list(recent),
    }


async def read_live(p2p: Any, records: Iterable[PeerRecord], timeout_s: float) -> dict[str, LiveInfo]:
    """Ask every serving peer for its live counters at once; a peer that does not answer is left out."""

    async def ask(record: PeerRecord) -> tuple[str, LiveInfo | None]:
        try:
            info = await call_info(p2p, record.peer_id, maddrs=list(record.maddrs), timeout_s=timeout_s)
        except (SwarmError, TimeoutError, ConnectionError, OSError) as error:
            logger.debug("peer %s did not answer info: %s", record.peer_id[-8:], error)
            return record.peer_id, None
        live = LiveInfo(
            info.free_cache_tokens, info.active_sessions, info.state, info.background_bytes, info.cache
        )
        return record.peer_id, live

    serving = [r for r in records if r.state == "serving"]
    answers = await asyncio.gather(*(ask(r) for r in serving))
    return {pid: info for pid, info in answers if info is not None}
