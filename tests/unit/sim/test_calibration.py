"""swarm.sim.calibration: probes -> node fields, and closed-loop predictions that respect the probed costs."""

from __future__ import annotations

from typing import Any

import pytest

from swarm.planner.cluster import Cluster, ClusterNode, ModelInfo, full_mesh_links
from swarm.sim.calibration import TESTBED_HOST, Probed, apply_probes, predict_tokens_s, without_hosts
from swarm.types import LayerRange, NodeID

pytestmark = pytest.mark.timeout(60)

STEP_B1_S, STEP_B8_S, FORWARD_S, CLIENT_S = 0.020, 0.010, 0.004, 0.006  # b8 below b1: must be clamped up
PROBED = Probed(
    step_cpu_s={"a": (STEP_B1_S, STEP_B8_S), "b": (STEP_B1_S, STEP_B8_S)},
    step_wall_s={"a": (STEP_B1_S, STEP_B8_S), "b": (STEP_B1_S, STEP_B8_S)},
    forward_s={"a": FORWARD_S},
    client_cpu_s=CLIENT_S,
    route_cpu_s=0.05,
    parallel_speed=0.9,
)
PLACEMENT = {NodeID("a"): LayerRange(0, 2), NodeID("b"): LayerRange(2, 4)}


def probed_cluster(cores: int) -> Cluster:
    nodes = tuple(ClusterNode(NodeID(n), "r0", 4, (100.0, 50.0, 33.0, 25.0)) for n in ("a", "b"))
    data: dict[str, Any] = Cluster(
        ModelInfo("m", 4, 1024), nodes, full_mesh_links(nodes, latency_s=0.0)
    ).to_json()
    for node in data["nodes"]:
        apply_probes(node, 2, PROBED, cores)
    return Cluster.from_json(data)


def test_probes_become_node_fields() -> None:
    node: dict[str, Any] = {"id": "a"}
    apply_probes(node, 2, PROBED, 3)
    assert node["decode_s_per_layer"] == [[1, STEP_B1_S / 2], [8, STEP_B1_S / 2]]  # b8 never below b1
    assert node["forward_s"] == FORWARD_S
    assert (node["host"], node["host_cores"], node["host_parallel_speed"]) == (TESTBED_HOST, 3, 0.9)
    other: dict[str, Any] = {"id": "b"}
    apply_probes(other, 2, PROBED, 3)
    assert other["forward_s"] == 0.0  # the last peer forwards nothing
    assert all("host" not in n.extra for n in without_hosts(probed_cluster(1)).nodes)


def test_one_session_is_bounded_by_its_probed_costs() -> None:
    # One session, one core each: every decode token costs at least both steps, a's forward and the client.
    per_token_s = 2 * STEP_B1_S + FORWARD_S + CLIENT_S
    alone = predict_tokens_s(probed_cluster(4), PLACEMENT, 1, 4, 40, CLIENT_S)
    assert alone <= 1 / per_token_s
    assert alone > 0.8 / per_token_s  # the prefill is the only other cost
    # The same on one shared core is no faster, and a slower client is slower.
    assert predict_tokens_s(probed_cluster(1), PLACEMENT, 1, 4, 40, CLIENT_S) <= alone + 1e-9
    assert predict_tokens_s(probed_cluster(4), PLACEMENT, 1, 4, 40, 10 * CLIENT_S) < alone


def test_sessions_on_one_core_share_it() -> None:
    # Four sessions on one shared core: the peers' steps and the client's heads can no longer overlap, so the
    # aggregate rate stays below what four own cores give.
    shared = predict_tokens_s(probed_cluster(1), PLACEMENT, 4, 4, 40, CLIENT_S)
    own = predict_tokens_s(probed_cluster(1), PLACEMENT, 4, 4, 40, CLIENT_S, shared_host=False)
    assert 0 < shared < own
