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
    args = ["--model", "tiny", "--concurrency", "2", "--prompt-tokens", "4", "--new-tokens", "3"]
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
    keys = {
        "model", "peers", "concurrency", "prompt_tokens", "new_tokens", "measured_decode_tokens_s",
        "simulated_decode_tokens_s", "error_fraction", "within_15pct",
    }  # fmt: skip
    assert keys <= set(report)
    assert report["peers"] == 3 and report["concurrency"] == 2
    assert (report["prompt_tokens"], report["new_tokens"]) == (4, 3)
    assert report["measured_decode_tokens_s"] > 0 and report["simulated_decode_tokens_s"] > 0
    assert isinstance(report["within_15pct"], bool)
    cluster = json.loads((tmp_path / "CLUSTER.json").read_text())
    assert len(cluster["nodes"]) == 3
    assert all("decode_s_per_layer" in node for node in cluster["nodes"])
