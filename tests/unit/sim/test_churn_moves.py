"""Issue 13's churn modelling on tiny clusters: partial replay, KV hand-over time, make before break,
chunked replays, and sessions that wait for a route instead of restarting."""

from __future__ import annotations

from dataclasses import replace

import pytest

from swarm.planner.cluster import Cluster, ClusterLink, ClusterNode, ModelInfo, full_mesh_links
from swarm.planner.graph import max_flow
from swarm.sim.churn import Churn, ChurnEvent
from swarm.sim.engine import Node, SimConfig, Simulation
from swarm.sim.experiment import churn_config
from swarm.sim.scheduling import router_factory
from swarm.sim.trace import Request
from swarm.types import LayerRange, NodeID, Plan

pytestmark = pytest.mark.timeout(30)

OLD = churn_config(SimConfig(bucket_s=1.0), "old", ())
NEW = SimConfig(bucket_s=1.0)
HALF = LayerRange(0, 2), LayerRange(2, 4)


def cluster_of(max_layers: dict[str, int], slow_link: tuple[str, str, float] | None = None) -> Cluster:
    model = ModelInfo("tiny", 4, 1024, 4)
    nodes = tuple(ClusterNode(NodeID(n), "r0", m, tuple([200.0] * m)) for n, m in max_layers.items())
    links = full_mesh_links(nodes, bandwidth_bytes_s=1e8, latency_s=0.002)
    if slow_link is not None:
        a, b, bandwidth = slow_link
        links = tuple(lk for lk in links if (lk.src, lk.dst) != (a, b)) + (
            ClusterLink(a, b, bandwidth, 0.002),
        )
    return Cluster(model, nodes, links)


def plan_of(cluster: Cluster, placement: dict[str, LayerRange]) -> Plan:
    return max_flow(cluster, {NodeID(n): r for n, r in placement.items()}, "hand")


def one_request(output_tokens: int = 40) -> list[Request]:
    return [Request(0, 0.0, 100, output_tokens)]


def simulation(
    cluster: Cluster, placement: dict[str, LayerRange], trace: list[Request], config: SimConfig
) -> Simulation:
    return Simulation(cluster, plan_of(cluster, placement), router_factory(cluster, "iwrr", 0), trace, config)


def names(sim: Simulation, r: int) -> list[str]:
    return [str(sim.ids[i]) for i in sim.requests.routes[r]]


@pytest.mark.parametrize(("config", "stages_replayed"), [(NEW, 1), (OLD, 2)])
def test_a_failover_replays_only_the_replaced_stage(config: SimConfig, stages_replayed: int) -> None:
    cluster = cluster_of({"a": 2, "b": 2, "c": 2})
    sim = simulation(cluster, {"a": HALF[0], "b": HALF[0], "c": HALF[1]}, one_request(), config)
    seen: dict[str, object] = {}

    def kill_first_stage() -> None:
        first = sim.requests.routes[0][0]
        seen["length"] = sim.requests.length(0)
        seen["lost"] = str(sim.ids[first])
        for r in sim.remove(first):
            sim.fail_over(r, first)
        seen["route"] = names(sim, 0)

    sim.at(2.0, kill_first_stage)
    sim.run()
    assert sim.requests.done_s[0] >= 0 and sim.counters.restarts == 0 and sim.counters.failovers == 1
    assert sim.requests.generated[0] == 40 and int(seen["length"]) > 100  # type: ignore[call-overload]
    assert sim.counters.replayed_tokens == stages_replayed * int(seen["length"])  # type: ignore[call-overload]
    assert seen["route"][0] != seen["lost"] and seen["route"][1] == "c"  # type: ignore[index]
    assert (0 in sim.nodes[sim.index[NodeID("c")]].sessions) is False  # released at the end


def _hand_over_run(bandwidth: float) -> tuple[float, int]:
    """a (0:2) leaves at t = 2 s, b takes its layers; the link a -> b has `bandwidth`. -> (done_s, bytes)."""
    cluster = cluster_of({"a": 2, "b": 2, "c": 2}, slow_link=("a", "b", bandwidth))
    sim = simulation(cluster, {"a": HALF[0], "c": HALF[1]}, one_request(), NEW)
    sent: list[int] = []

    def leave() -> None:
        a = sim.index[NodeID("a")]
        sim.set_layers(sim.index[NodeID("b")], HALF[0])
        sim.set_plan(plan_of(cluster, {"b": HALF[0], "c": HALF[1]}))
        sent.append(sim.moves.kv_bytes(2, sim.requests.length(0)))
        sim.give_up(a, sim.remove(a))

    sim.at(2.0, leave)
    sim.run()
    assert (
        sim.counters.handovers == 1
        and sim.counters.failovers == 0
        and sim.counters.replayed_tokens == 0
        and sim.counters.restarts == 0
    )
    assert sim.requests.generated[0] == 40 and names(sim, 0) == ["b", "c"]
    assert (
        sim.counters.handover_bytes == sent[0] > 100 * 2 * 2 * 1024 * 0.125
    )  # 2 layers x K, V x 128 B x tokens
    return sim.requests.done_s[0], sent[0]


def test_kv_hand_over_takes_bytes_over_the_link_and_replays_nothing() -> None:
    fast_done, fast_bytes = _hand_over_run(1e9)
    slow_done, slow_bytes = _hand_over_run(1e6)
    # The slow link delays the session by the stream's time: bytes / bandwidth.
    assert slow_done - fast_done == pytest.approx(slow_bytes / 1e6 - fast_bytes / 1e9, rel=0.05)


def _move_b(config: SimConfig, b_max: int, b_to: LayerRange) -> tuple[Simulation, Churn]:
    """a, b hold 0:2 and c 2:4; at t = 1 s node e joins and the plan moves b to `b_to`, e to 0:2."""
    cluster = cluster_of({"a": 2, "b": b_max, "c": 2, "e": 2})
    trace = [Request(i, 0.1 * i, 60, 30) for i in range(12)]
    sim = simulation(cluster, {"a": HALF[0], "b": HALF[0], "c": HALF[1]}, trace, config)
    target = {"a": HALF[0], "b": b_to, "c": HALF[1], "e": HALF[0]}

    def replan(c: Cluster, current: dict[NodeID, LayerRange] | None) -> Plan:
        return plan_of(c, target)

    present = {NodeID(n) for n in "abc"}
    churn = Churn(sim, [ChurnEvent(1.0, NodeID("e"), True)], replan, present, reload_s_per_layer=0.5)
    return sim, churn


def test_a_node_whose_new_range_contains_the_old_keeps_its_sessions() -> None:
    sim, churn = _move_b(NEW, 4, LayerRange(0, 4))
    b = sim.nodes[sim.index[NodeID("b")]]
    held: list[int] = []
    sim.at(1.0 + 1e-6, lambda: held.append(len(b.sessions)))
    sim.run()
    assert held[0] > 0 and b.layers == LayerRange(0, 4)
    assert sim.counters.failovers == sim.counters.handovers == sim.counters.restarts == 0 and all(
        t >= 0 for t in sim.requests.done_s
    )
    assert churn.events()[0]["nodes_moved"] == 1


def test_make_before_break_drains_the_old_range_and_takes_new_sessions_only_on_the_new() -> None:
    sim, _ = _move_b(NEW, 4, HALF[1])  # 0:2 and 2:4 both fit b's 4 layers
    b_index = sim.index[NodeID("b")]
    b = sim.nodes[b_index]
    checks: list[tuple[bool, bool]] = []

    def after_switch() -> None:  # 1 s + 2 layers x 0.5 s: loaded
        checks.append((b.layers == HALF[1], b.old_layers == HALF[0] and bool(b.draining)))

    sim.at(2.0 + 1e-6, after_switch)
    sim.run()
    assert checks == [(True, True)]
    assert sim.counters.failovers == sim.counters.handovers == sim.counters.restarts == 0 and all(
        t >= 0 for t in sim.requests.done_s
    )
    assert b.old_layers is None and not b.draining  # dropped once its sessions ended
    late = [
        r for r in range(len(sim.trace)) if sim.trace[r].arrival_s > 2.0 and b_index in sim.requests.routes[r]
    ]
    assert all(sim.requests.stage_starts[r][list(sim.requests.routes[r]).index(b_index)] == 2 for r in late)


@pytest.mark.parametrize(("config", "kind"), [(NEW, "handovers"), (OLD, "failovers")])
def test_a_move_that_does_not_fit_hands_sessions_over(config: SimConfig, kind: str) -> None:
    sim, _ = _move_b(config, 2, HALF[1])
    b = sim.nodes[sim.index[NodeID("b")]]
    before: list[int] = []
    sim.at(1.0 - 1e-6, lambda: before.append(len(b.sessions)))
    sim.run()
    # Sessions still prefilling have no complete KV to hand over: they replay their prompt instead.
    assert before[0] > 0 and sim.counters.handovers + sim.counters.failovers == before[0]
    assert getattr(sim.counters, kind) > before[0] // 2
    assert sim.counters.restarts == 0 and all(t >= 0 for t in sim.requests.done_s)


def test_replays_are_taken_in_chunks_so_decode_keeps_going() -> None:
    cluster = cluster_of({"a": 2, "c": 2})
    sim = simulation(
        cluster, {"a": HALF[0], "c": HALF[1]}, one_request(), replace(NEW, replay_chunk_tokens=256)
    )
    node = Node(NodeID("x"))
    sim.requests.replaying[0] = True
    sim.batcher.queue_prefill(node, [(0 << 8 | 1, 1000)])
    taken = []
    for _ in range(4):
        sim.batcher.take_replays(node)
        taken.append((node.cur_replay_tokens, list(node.cur_replay)))
    assert taken == [(256, []), (256, []), (256, []), (232, [(1, 1000)])]
    unchunked = simulation(cluster, {"a": HALF[0], "c": HALF[1]}, one_request(), OLD)
    unchunked.requests.replaying[0] = True
    unchunked.batcher.queue_prefill(node, [(1, 1000)])
    assert list(node.prefill_q) == [(1, 1000)]


def test_a_session_with_no_route_waits_instead_of_restarting() -> None:
    cluster = cluster_of({"a": 2, "c": 2})
    sim = simulation(cluster, {"a": HALF[0], "c": HALF[1]}, one_request(60), NEW)
    c = sim.index[NodeID("c")]
    stalled: list[int] = []

    def kill() -> None:
        for r in sim.remove(c):
            sim.fail_over(r, c)
        stalled.append(len(sim.moves.stalled))

    sim.at(1.0, kill)
    sim.at(3.0, lambda: sim.set_layers(c, HALF[1]))
    sim.run()
    assert stalled == [1] and not sim.moves.stalled
    assert sim.counters.restarts == 0 and sim.requests.done_s[0] > 3.0 and sim.requests.generated[0] == 60
