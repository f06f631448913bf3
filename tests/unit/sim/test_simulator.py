"""Simulator sanity on tiny clusters: bounded by max flow and compute time, deterministic, IWRR vs random."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from swarm.planner.cluster import Cluster, ClusterNode, ModelInfo, full_mesh_links
from swarm.planner.graph import max_flow
from swarm.sim.churn import Churn, ChurnEvent, present_cluster
from swarm.sim.engine import SimConfig, Simulation
from swarm.sim.report import summarize
from swarm.sim.scheduling import router_factory
from swarm.sim.timing import NodeTiming, Table, TimingDefaults
from swarm.sim.trace import TraceConfig, make_trace
from swarm.types import LayerRange, NodeID, Plan

pytestmark = pytest.mark.timeout(60)

SHORT = TraceConfig(mean_prompt_tokens=60, mean_output_tokens=20, max_prompt_tokens=200, max_output_tokens=60)
FULL = SimConfig().max_batch_tokens  # the batch at which derived timing reaches a node's tokens_s


def tiny_cluster(speeds: dict[str, float], num_layers: int = 4) -> Cluster:
    model = ModelInfo("tiny", num_layers, 1024, 4)
    nodes = tuple(
        ClusterNode(NodeID(n), "r0", num_layers, tuple([s] * num_layers)) for n, s in speeds.items()
    )
    return Cluster(model, nodes, full_mesh_links(nodes, bandwidth_bytes_s=1e8, latency_s=0.002))


def run(cluster: Cluster, plan: Plan, scheduling: str, n: int, rate: float | None, seed: int = 0) -> dict:
    trace = make_trace(n, rate, seed, SHORT)
    sim = Simulation(cluster, plan, router_factory(cluster, scheduling, seed), trace, SimConfig(bucket_s=1.0))
    return summarize(sim.run(), plan.method, scheduling)


def two_stage_plan(cluster: Cluster) -> Plan:
    """a, b hold layers 0:2; c, d hold 2:4."""
    placement = {NodeID("a"): LayerRange(0, 2), NodeID("b"): LayerRange(0, 2)}
    placement |= {NodeID("c"): LayerRange(2, 4), NodeID("d"): LayerRange(2, 4)}
    return max_flow(cluster, placement, "hand")


def test_offline_throughput_never_exceeds_max_flow_and_nothing_is_lost() -> None:
    cluster = tiny_cluster({"a": 300.0, "b": 100.0, "c": 200.0, "d": 200.0})
    plan = two_stage_plan(cluster)
    row = run(cluster, plan, "iwrr", 400, None)
    assert row["lost_requests"] == 0 and row["completed_requests"] == 400
    assert 0 < row["decode_tokens_s"] <= plan.max_flow_tokens_s
    assert all(u <= 1.0 + 1e-9 for u in row["node_utilisation"]["per_node"].values())


def test_latency_is_at_least_the_compute_time() -> None:
    cluster = tiny_cluster({"a": 300.0, "b": 100.0, "c": 200.0, "d": 200.0})
    plan = two_stage_plan(cluster)
    row = run(cluster, plan, "iwrr", 30, 0.2)  # light load: batches of one
    defaults = TimingDefaults()
    # A step runs layers 0:2 on a or b, then 2:4 on c or d: at least the faster of each at batch one.
    fastest_step_s = NodeTiming("a", 300.0, 2, {}, defaults, FULL).decode_s(1) + NodeTiming(
        "c", 200.0, 2, {}, defaults, FULL
    ).decode_s(1)
    assert row["decode_latency_s"]["p50"] >= fastest_step_s
    assert row["prompt_latency_s"]["p50"] > 0


def test_same_seed_same_result() -> None:
    cluster = tiny_cluster({"a": 300.0, "b": 100.0, "c": 200.0, "d": 200.0})
    plan = two_stage_plan(cluster)
    first = run(cluster, plan, "random", 150, 5.0, seed=3)
    second = run(cluster, plan, "random", 150, 5.0, seed=3)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert json.dumps(run(cluster, plan, "random", 150, 5.0, seed=4)) != json.dumps(first)


def test_iwrr_beats_random_when_speeds_are_skewed() -> None:
    # a is three times b: the plan sends 3/4 of the flow through a; random splits it evenly and b saturates.
    cluster = tiny_cluster({"a": 300.0, "b": 100.0, "c": 400.0, "d": 400.0})
    plan = two_stage_plan(cluster)
    iwrr = run(cluster, plan, "iwrr", 400, None)
    rand = run(cluster, plan, "random", 400, None)
    assert iwrr["decode_tokens_s"] > rand["decode_tokens_s"] * 1.05
    assert iwrr["decode_tokens_s"] <= plan.max_flow_tokens_s


def test_churn_fails_over_without_losing_requests() -> None:
    cluster = tiny_cluster({"a": 300.0, "b": 300.0, "c": 300.0, "d": 300.0})
    plan = two_stage_plan(cluster)
    trace = make_trace(200, 4.0, 0, SHORT)
    sim = Simulation(cluster, plan, router_factory(cluster, "iwrr", 0), trace, SimConfig(bucket_s=1.0))

    def replan(c: Cluster, current: dict[NodeID, LayerRange] | None) -> Plan:
        kept = {n: r for n, r in (current or {}).items() if n in c.node_by_id}
        return max_flow(c, kept, "hand")

    present = {NodeID(n) for n in "abcd"}
    events = [ChurnEvent(10.0, NodeID("a"), False), ChurnEvent(20.0, NodeID("c"), False)]
    churn = Churn(sim, events, replan, present, reload_s_per_layer=0.5)
    row = summarize(sim.run(), "hand", "iwrr")
    assert sim.counters.failovers + sim.counters.handovers > 0 and churn.replans == 2
    assert row["lost_requests"] == 0
    assert present_cluster(cluster, {NodeID("b")}).node_by_id.keys() == {"b"}


def test_derived_timing_reaches_the_planners_tokens_s_at_a_full_batch() -> None:
    defaults = TimingDefaults()
    timing = NodeTiming("n", 250.0, 6, {}, defaults, FULL)
    assert timing.peak_decode_tokens_s(FULL) == pytest.approx(250.0)  # what the max flow counts on
    # A batch of one pays the whole fixed part (worth 8 tokens) for one token: (8 + 32) / 32 / (8 + 1) of peak.
    assert timing.peak_decode_tokens_s(1) == pytest.approx(250.0 * 40 / 32 / 9)
    # A prompt token costs prefill_token_cost of a decode token at full batch, above the same fixed part.
    extra_s = timing.prefill_s(1000) - timing.prefill_s(0)
    assert extra_s == pytest.approx(1000 * defaults.prefill_token_cost / 250.0)
    assert timing.prefill_s(0) == pytest.approx(timing.decode_s(0))


def test_timing_tables_interpolate_and_reject_bad_input() -> None:
    table = Table([[1, 0.01], [9, 0.05]], "t")
    assert table(5) == pytest.approx(0.03)
    assert table(17) == pytest.approx(0.09)  # extended along the last segment
    timing = NodeTiming(
        "n",
        0.0,
        4,
        {"decode_s_per_layer": [[1, 0.01], [9, 0.05]], "prefill_s_per_layer": [[100, 0.1]]},
        TimingDefaults(),
        FULL,
    )
    assert timing.decode_s(5) == pytest.approx(0.12)
    assert timing.prefill_s(200) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        Table([], "empty")
    with pytest.raises(ValueError):
        NodeTiming("n", 0.0, 4, {}, TimingDefaults(), FULL)


def test_trace_means_and_limits() -> None:
    trace = make_trace(20_000, 2.0, 1)
    prompts = [r.prompt_tokens for r in trace]
    outputs = [r.output_tokens for r in trace]
    assert abs(sum(prompts) / len(prompts) - 763) < 8 and max(prompts) <= 2048
    assert abs(sum(outputs) / len(outputs) - 232) < 3 and max(outputs) <= 1024
    assert abs(trace[-1].arrival_s / len(trace) - 0.5) < 0.02  # Poisson at 2/s


def test_cli_writes_json(tmp_path: Path) -> None:
    main = runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "simulate.py"))["main"]

    cluster = tiny_cluster({"a": 300.0, "b": 300.0})
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster.to_json()))
    out = tmp_path / "out.json"
    assert (
        main(
            [
                str(path),
                "--requests",
                "20",
                "--placements",
                "greedy",
                "--scheduling",
                "iwrr,swarm",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["scheduling"] for r in rows] == ["iwrr", "swarm"]
    assert all(r["lost_requests"] == 0 for r in rows)


def test_decode_quantum_keeps_throughput_and_cuts_events() -> None:
    cluster = tiny_cluster({"a": 300.0, "b": 100.0, "c": 200.0, "d": 200.0})
    plan = two_stage_plan(cluster)
    trace = make_trace(200, 3.0, 0, SHORT)
    results = {}
    for k in (1, 4):
        sim = Simulation(
            cluster, plan, router_factory(cluster, "iwrr", 0), trace, SimConfig(decode_quantum_tokens=k)
        )
        results[k] = (summarize(sim.run(), "hand", "iwrr"), sim.events.pushed)
    (exact, exact_events), (coarse, coarse_events) = results[1], results[4]
    assert coarse_events < exact_events / 2
    assert coarse["lost_requests"] == 0
    assert abs(coarse["decode_tokens_s"] / exact["decode_tokens_s"] - 1) < 0.1
    with pytest.raises(ValueError):
        Simulation(
            cluster, plan, router_factory(cluster, "iwrr", 0), trace, SimConfig(decode_quantum_tokens=0)
        )
