"""Split phases in the simulator: sessions prefill on the plan's prefill route, move their KV to a decode route
(bytes over the link, FIFO), decode there; and scripts/simulate.py --split-phases."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from swarm.planner.cluster import Cluster, ClusterNode, ModelInfo, full_mesh_links
from swarm.planner.graph import max_flow
from swarm.planner.solve import solve
from swarm.planner.split import PREFILL_KEY, SplitConfig, split_plan
from swarm.planner.two_class import two_class_cluster
from swarm.sim.config import SimConfig
from swarm.sim.engine import Simulation
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import Request, make_trace
from swarm.types import SOURCE, LayerRange, NodeID

LINK_BYTES_S = 1e8
LATENCY_S = 0.002


def simulate_main() -> object:
    return runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "simulate.py"))["main"]


def two_node_split() -> tuple[Cluster, object]:
    """Two layers on both nodes: g prefills 10x faster than it decodes, o decodes as fast; the split plan
    prefills on g and decodes on o."""
    nodes = (
        ClusterNode(NodeID("g"), "r0", 2, (200.0, 100.0), {PREFILL_KEY: [2000.0, 1000.0]}),
        ClusterNode(NodeID("o"), "r0", 2, (200.0, 100.0), {PREFILL_KEY: [200.0, 100.0]}),
    )
    cluster = Cluster(ModelInfo("tiny", 2, 1024, 4), nodes, full_mesh_links(nodes, LINK_BYTES_S, LATENCY_S))
    today = max_flow(cluster, {NodeID("g"): LayerRange(0, 2), NodeID("o"): LayerRange(0, 2)})
    plan = split_plan(cluster, today, SplitConfig(prompt_tokens_per_output=3.0, mean_output_tokens=1.0))
    return cluster, plan


def test_one_session_moves_its_prompt_kv_over_the_link() -> None:
    cluster, plan = two_node_split()
    assert plan.decode_flows  # type: ignore[attr-defined]
    assert {f.dst for f in plan.flows if f.src == SOURCE} == {"g"}  # type: ignore[attr-defined]
    trace = [Request(0, 0.0, 100, 5)]
    config = SimConfig()
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, config).run()  # type: ignore[arg-type]
    assert sim.requests.done_s[0] > 0 and sim.requests.generated[0] == 5
    # KV of the prompt, both layers: 2 (K, V) * activation bytes * KV-head share, a token and layer.
    expected = int(2 * 2 * 1024 * config.kv_heads_fraction * 100)
    assert sim.counters.phase_moves == 1 and sim.counters.phase_move_bytes == expected
    assert abs(sim.counters.phase_move_s - (expected / LINK_BYTES_S + LATENCY_S)) < 1e-9
    assert sim.requests.routes[0] == (sim.index[NodeID("o")],)  # it decoded on o
    assert all(node.cache_used == 0 and not node.sessions for node in sim.nodes)


def test_split_sessions_decode_on_the_decode_route_and_free_every_cache() -> None:
    cluster = two_class_cluster(8, 8)
    plan = split_plan(cluster, solve(cluster, "milp", time_limit_s=1.0), SplitConfig(session_tokens_s=3.0))
    assert plan.decode_flows
    trace = make_trace(40, 0.5, 0)
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, SimConfig()).run()
    assert all(t >= 0 for t in sim.requests.done_s)
    assert sim.counters.phase_moves == sum(1 for r in trace if r.output_tokens > 1)
    decoding = {f.dst for f in plan.decode_flows}
    prefilling = {f.dst for f in plan.flows}
    for r in range(len(trace)):
        route = {sim.ids[i] for i in sim.requests.routes[r]}
        assert route <= decoding, f"request {r} ended on {route}, off the decode flow"
    assert prefilling and not any(n.startswith("mi50") for n in prefilling), "prompts go to the gaming cards"
    assert all(node.cache_used == 0 and not node.sessions for node in sim.nodes)


def test_cli_split_phases_reports_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    args = ["twoclass", "--split-phases", "--requests", "60", "--plan-time-limit-s", "1", "--json", str(out)]
    assert simulate_main()(args) == 0  # type: ignore[operator]
    result = json.loads(out.read_text())
    assert result["split_planned"] is True
    assert result["sim_throughput_ratio"] > 0 and result["sim_ttft_p90_ratio"] > 0
    online = result["online"]
    assert online["split"]["kv_moves"] == online["split"]["completed"] == 60 - count_single_token(60)
    assert online["single"]["kv_moves"] == 0
    # The prompts run on the prefill-strong cards: the first token comes sooner at the same arrival rate.
    assert result["sim_ttft_p90_ratio"] < 1.0


def count_single_token(n: int) -> int:
    return sum(1 for r in make_trace(n, None, 0) if r.output_tokens <= 1)


def test_cli_split_phases_without_prefill_speeds_compares_like_with_like(tmp_path: Path) -> None:
    nodes = tuple(ClusterNode(NodeID(n), "r0", 4, (300.0,) * 4) for n in ("a", "b"))
    cluster = Cluster(ModelInfo("tiny", 4, 1024, 4), nodes, full_mesh_links(nodes, LINK_BYTES_S, LATENCY_S))
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster.to_json()))
    out = tmp_path / "split.json"
    args = [str(path), "--split-phases", "--requests", "20", "--plan-time-limit-s", "1", "--json", str(out)]
    assert simulate_main()(args) == 0  # type: ignore[operator]
    result = json.loads(out.read_text())
    assert result["split_planned"] is False
    assert result["sim_throughput_ratio"] == 1.0 and result["sim_ttft_p90_ratio"] == 1.0


def test_a_session_decoding_where_it_prefilled_moves_nothing() -> None:
    cluster, plan = two_node_split()  # decode flows: about 54 tokens/s through g, 100 through o
    trace = [Request(r, 5.0 * r, 100 + r, 5) for r in range(6)]
    config = SimConfig()
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, config).run()  # type: ignore[arg-type]
    on_o = [r for r in range(len(trace)) if sim.requests.routes[r] == (sim.index[NodeID("o")],)]
    on_g = [r for r in range(len(trace)) if sim.requests.routes[r] == (sim.index[NodeID("g")],)]
    assert on_o and on_g and len(on_o) + len(on_g) == len(trace)
    per_token = 2 * 2 * 1024 * config.kv_heads_fraction  # K and V of both layers
    assert sim.counters.phase_move_bytes == sum(int(per_token * trace[r].prompt_tokens) for r in on_o)
    assert sim.counters.phase_moves == len(trace)


def test_a_one_token_session_ends_before_moving_and_frees_both_routes() -> None:
    cluster, plan = two_node_split()
    trace = [Request(0, 0.0, 100, 1), Request(1, 0.0, 50, 1)]
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, SimConfig()).run()  # type: ignore[arg-type]
    assert all(t >= 0 for t in sim.requests.done_s) and sim.counters.phase_moves == 0
    assert all(node.cache_used == 0 and not node.sessions for node in sim.nodes)
