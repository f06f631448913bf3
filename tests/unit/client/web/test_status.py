"""The status document: peers with live counters where known, coverage, planner, plan flows named."""

from __future__ import annotations

from client.web.status import LiveInfo, status_json
from swarm.dht import PlanRecord, SwarmSnapshot
from swarm.types import SINK, SOURCE, EdgeFlow, LayerRange, NodeID, Plan
from swarm.wire import CacheStats
from tests.unit.dht.records import peer_record


def test_status_names_flows_and_prefers_live_counters() -> None:
    a, b = peer_record("QmA", 0, 4, name="alpha"), peer_record("QmB", 4, 8, name="beta", active_sessions=2)
    plan = Plan(
        "milp",
        {NodeID("QmA"): LayerRange(0, 4), NodeID("QmB"): LayerRange(4, 8)},
        10.0,
        (
            EdgeFlow(SOURCE, NodeID("QmA"), 10.0),
            EdgeFlow(NodeID("QmA"), NodeID("QmB"), 10.0),
            EdgeFlow(NodeID("QmB"), SINK, 10.0),
        ),
        epoch=3,
    )
    record = PlanRecord(epoch=3, planner_peer_id="QmA", plan=plan.to_json(), created_at=1.0)
    snapshot = SwarmSnapshot(peers={"QmB": b, "QmA": a}, plan=record, planner_peer_id="QmA", fetched_at=2.0)
    cache = CacheStats(16, 12, 3, 20, 400, 300)
    live = {"QmB": LiveInfo(free_cache_tokens=100, active_sessions=0, state="serving", cache=cache)}
    status = status_json(snapshot, 10, "tiny", live, [{"kind": "chat"}])
    assert [p["name"] for p in status["peers"]] == ["alpha", "beta"]
    beta = status["peers"][1]
    assert (beta["active_sessions"], beta["free_cache_tokens"], beta["live"]) == (0, 100, True)
    assert beta["kv_cache"] == {
        **{"block_tokens": 16, "used_blocks": 12, "shared_blocks": 3, "free_blocks": 20},
        **{"prefix_tokens_looked_up": 400, "prefix_tokens_shared": 300, "prefix_hit_rate": 0.75},
    }
    assert status["peers"][0]["live"] is False and status["peers"][0]["kv_cache"] is None
    assert status["coverage"] == [1] * 8 + [0, 0] and status["missing_layers"] == [8, 9]
    assert status["planner"] == {"peer_id": "QmA", "name": "alpha"}
    flows = status["plan"]["flows"]
    assert [(f["src_name"], f["dst_name"]) for f in flows] == [
        ("client (embed)", "alpha"),
        ("alpha", "beta"),
        ("beta", "client (LM head)"),
    ]
    assert status["plan"]["epoch"] == 3 and status["recent_requests"] == [{"kind": "chat"}]


def test_status_without_a_plan() -> None:
    snapshot = SwarmSnapshot(peers={}, plan=None, planner_peer_id=None, fetched_at=0.0)
    status = status_json(snapshot, 2, "tiny", {}, [])
    assert status["plan"] is None and status["planner"] is None and status["missing_layers"] == [0, 1]
