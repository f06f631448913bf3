"""Cluster JSON round trips, clear errors on bad input, and the CLI's solve -> evaluate round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.planner.__main__ import main
from swarm.planner.cluster import Cluster, load_cluster, with_full_mesh
from swarm.planner.synthetic import helix_24
from swarm.types import SOURCE, NodeID, Plan
from tests.unit.planner.helpers import mesh_cluster, node

pytestmark = pytest.mark.timeout(60)


def test_cluster_json_round_trip_keeps_extra_fields(tmp_path: Path) -> None:
    cluster = helix_24(3)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster.to_json()))
    loaded = load_cluster(path)
    assert loaded == cluster
    assert loaded.nodes[0].extra == {"gpu": "A100"}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "duplicate node ids"),
        (lambda d: d["links"].append({"src": "a", "dst": "ghost", "bandwidth_bytes_s": 1.0}), "unknown node"),
        (lambda d: d["nodes"][0].pop("max_layers"), "missing or malformed field"),
        (lambda d: d["nodes"][0].update(max_layers=9), "tokens_s_by_layers has 2 entries"),
        (lambda d: d["model"].update(num_layers=0), "num_layers must be >= 1"),
        (lambda d: d["nodes"][0].update(id="sink"), "reserved"),
    ],
)
def test_bad_cluster_json_is_a_clear_error(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = mesh_cluster([node("a", 2, 10.0), node("b", 2, 10.0)], 4).to_json()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        Cluster.from_json(data)


def test_full_mesh_helper_fills_only_missing_links() -> None:
    cluster = Cluster(mesh_cluster([node("a", 2, 10.0)], 2).model, (node("a", 2, 10.0), node("b", 2, 10.0)))
    meshed = with_full_mesh(cluster, bandwidth_bytes_s=5.0)
    assert meshed.bandwidth_bytes_s(NodeID("a"), NodeID("b")) == 5.0
    assert meshed.bandwidth_bytes_s(SOURCE, NodeID("b")) == 5.0
    assert cluster.bandwidth_bytes_s(NodeID("a"), NodeID("b")) == 0.0


def test_cli_solve_then_evaluate_round_trip(tmp_path: Path) -> None:
    cluster_path, plan_path, eval_path = tmp_path / "c.json", tmp_path / "plan.json", tmp_path / "eval.json"
    cluster_path.write_text(json.dumps(helix_24().to_json()))
    assert main(["solve", str(cluster_path), "--method", "swarm", "--json", str(plan_path)]) == 0
    plan = Plan.from_json(json.loads(plan_path.read_text()))
    assert plan.method == "swarm" and plan.max_flow_tokens_s > 0
    # The evaluate command runs as a real subprocess, as a user would.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.planner",
            "evaluate",
            str(cluster_path),
            str(plan_path),
            "--json",
            str(eval_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    evaluated = Plan.from_json(json.loads(eval_path.read_text()))
    assert evaluated.placement == plan.placement
    assert evaluated.max_flow_tokens_s == pytest.approx(plan.max_flow_tokens_s)
    assert {(f.src, f.dst) for f in evaluated.flows} == {(f.src, f.dst) for f in plan.flows}


def test_cli_rejects_an_invalid_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster_path, plan_path = tmp_path / "c.json", tmp_path / "p.json"
    cluster_path.write_text(json.dumps(mesh_cluster([node("a", 2, 10.0)], 4).to_json()))
    plan_path.write_text(json.dumps({"placement": {"a": [0, 2]}}))
    assert main(["evaluate", str(cluster_path), str(plan_path)]) == 2
    assert "layers 2:4 are held by no node" in capsys.readouterr().err
