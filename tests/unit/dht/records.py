"""Record builders shared by the DHT tests."""

from __future__ import annotations

from typing import Any

from swarm import PROTOCOL_VERSION
from swarm.dht.schemas import LinkMeasure, PeerRecord

MODEL_HASH = "abc123def456"


def peer_record(peer_id: str, start: int = 0, end: int = 4, **changes: Any) -> PeerRecord:
    fields: dict[str, Any] = dict(
        peer_id=peer_id,
        name=f"peer-{peer_id[-4:]}",
        maddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}"],
        protocol_version=PROTOCOL_VERSION,
        model_name="tiny-llama",
        model_hash=MODEL_HASH,
        num_layers=8,
        hidden_size=64,
        device="cpu",
        dtype="float32",
        memory_bytes=2_000_000_000,
        state="serving",
        range_start=start,
        range_end=end,
        decode_layer_tokens_s_b1=400.0,
        decode_layer_tokens_s_b8=2000.0,
        prefill_layer_tokens_s=8000.0,
        max_layers=8,
        cache_tokens_total=4096,
        free_cache_tokens=4096,
        active_sessions=0,
        load=0.0,
        links={"QmOther": LinkMeasure(rtt_s=0.001, bandwidth_bytes_s=1e9)},
        reachable=None,
        updated_at=0.0,
    )
    fields.update(changes)
    return PeerRecord(**fields)
