"""Every benchmark and the simulator smoke-run at tiny size, so none of them can rot unnoticed.

These check only that each script runs and prints the JSON it promises; the figures themselves are
reported with the issues, measured at full size on a quiet machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run_json(args: list[str], timeout_s: float) -> object:
    env = {**os.environ, "FLOWSWARM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    text = proc.stdout.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a script may print progress lines before its JSON object
        start = text.index("\n{") + 1 if not text.startswith("{") else 0
        return json.loads(text[start:])


@pytest.mark.timeout(240)
def test_bench_local_tiny() -> None:
    out = _run_json(
        ["scripts/bench_local.py", "--json", "--model", "tiny", "--repeats", "1", "--new-tokens", "8"], 200
    )
    assert isinstance(out, dict)
    for key in (
        "model",
        "load_s_cold",
        "load_s_warm",
        "local_decode_tok_s",
        "split_decode_tok_s",
        "local_prefill_tok_s",
        "split_prefill_tok_s",
    ):
        assert key in out, key
    assert out["split_decode_tok_s"] > 0 and out["local_decode_tok_s"] > 0


@pytest.mark.timeout(240)
def test_bench_planner_quick(tmp_path: Path) -> None:
    out_file = tmp_path / "planner.json"
    _run_json(["scripts/bench_planner.py", "--quick", "--json", str(out_file)], 200)
    data = json.loads(out_file.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    methods = {row["method"] for row in rows}
    assert {"milp", "greedy", "swarm", "separate"} <= methods
    for row in rows:
        assert (
            row["max_flow_tokens_s"] >= 0 and row["upper_bound_tokens_s"] >= row["max_flow_tokens_s"] - 1e-6
        )


@pytest.mark.timeout(240)
def test_simulator_small(tmp_path: Path) -> None:
    out_file = tmp_path / "sim.json"
    _run_json(
        [
            "scripts/simulate.py",
            "random8",
            "--requests",
            "60",
            "--placements",
            "milp,greedy",
            "--scheduling",
            "iwrr,random",
            "--plan-time-limit-s",
            "2",
            "--json",
            str(out_file),
        ],
        200,
    )
    rows = json.loads(out_file.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        assert row["decode_tokens_s"] > 0
        assert row["prompt_latency_s"]["p50"] <= row["prompt_latency_s"]["p99"]


@pytest.mark.timeout(300)
def test_bench_peer_and_swarm_tiny() -> None:
    peer = _run_json(["scripts/bench_peer.py", "--model", "tiny", "--steps", "3"], 280)
    assert isinstance(peer, dict) and peer
    swarm = _run_json(
        ["scripts/bench_swarm.py", "--model", "tiny", "--new-tokens", "8", "--repeats", "1"], 280
    )
    assert isinstance(swarm, dict) and swarm
