"""scripts/calibrate.py end to end on the tiny model at minimal size: a real 3-peer swarm, one JSON line out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_calibrate_tiny_prints_one_report(tmp_path: Path) -> None:
    args = ["--model", "tiny", "--concurrency", "1,2", "--prompt-tokens", "4", "--new-tokens", "3"]
    args += ["--repeats", "1", "--timeout-s", "60", "--out-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "calibrate.py"), *args],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout
    report = json.loads(lines[0])
    keys = {"model", "peers", "prompt_tokens", "new_tokens", "runs", "within_15pct", "host_parallel_speed"}
    assert keys <= set(report)
    assert report["peers"] == 3 and [run["concurrency"] for run in report["runs"]] == [1, 2]
    assert (report["prompt_tokens"], report["new_tokens"]) == (4, 3)
    for run in report["runs"]:
        assert run["measured_decode_tokens_s"] > 0 and run["simulated_decode_tokens_s"] > 0
        assert isinstance(run["within_15pct"], bool)
    assert isinstance(report["within_15pct"], bool)
    assert 0 < report["host_parallel_speed"] <= 1
    cluster = json.loads((tmp_path / "CLUSTER.json").read_text())
    assert len(cluster["nodes"]) == 3
    for node in cluster["nodes"]:
        assert "decode_s_per_layer" in node and node["host"] == "loopback" and node["host_cores"] >= 1
