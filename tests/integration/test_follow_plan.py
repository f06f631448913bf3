"""Peers follow the elected planner's plan without a coverage gap: 3 real ``swarm-peer join`` processes.

The peers join with a useless placement of the 6-layer tiny model: all three on layers 0:3 (room for 4 layers
each, so nobody can hold all 6), leaving 3:6 unserved until the planner moves someone there. Only the last peer
stands for planner, so the first plan already sees all three. While the peers move to the planned ranges, a
client polls snapshots and checks that no layer, once served, ever loses its last serving peer; at the end
``swarm-peer status --json`` must show the planner, the plan's epoch and max flow, and every peer serving
exactly its planned range.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from swarm.dht import Directory, SwarmSnapshot, coverage
from swarm.models import resolve_model
from swarm.testing import REPO, LocalSwarm, swarm_client
from swarm.types import LayerRange, Plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

FAST = [
    "--max-memory-gb", "0.01",  # 4 tiny layers + their 8192-token KV cache each: nobody holds all 6
    "--record-ttl-s", "15",  # refreshed every 5 s: a busy machine must not expire a live record
    "--planner-lease-s", "3",
    "--planner-check-interval-s", "1",
    "--follow-check-interval-s", "1",
    "--follow-handover-timeout-s", "30",
    "--follow-session-grace-s", "2",
    "--shutdown-grace-s", "2",
]  # fmt: skip
FINAL_POLLS = 10  # snapshots after the peers first serve the plan that must all still show them there


@dataclass
class Watch:
    """What the polling client saw."""

    polls: int = 0
    min_coverage: list[int | None] = field(default_factory=list)  # per layer, since it was first served
    plan_seen_at: dict[int, float] = field(default_factory=dict)  # epoch -> monotonic time first seen
    ranges_seen: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    followed_at: float | None = None  # monotonic time all peers first served the latest plan
    followed_polls: int = 0  # polls since then
    unfollowed_polls: int = 0  # polls after that in which some peer did not serve its planned range
    followed_lag_s: float | None = None  # fetched_at - plan.created_at of that snapshot (DHT clock)
    plan: Plan | None = None
    status: subprocess.Popen[str] | None = None  # ``swarm-peer status --json``, started once peers followed


def _follows(snapshot: SwarmSnapshot, plan: Plan, peer_ids: list[str]) -> bool:
    serving = snapshot.serving()
    return all(
        pid in serving
        and LayerRange(serving[pid].range_start, serving[pid].range_end) == plan.placement.get(pid)  # type: ignore[call-overload]
        for pid in peer_ids
    )


async def _watch(
    watch: Watch,
    directory: Directory,
    peer_ids: list[str],
    num_layers: int,
    timeout_s: float,
    initial_peers: list[str],
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snapshot = await directory.snapshot()
        now = time.monotonic()
        watch.polls += 1
        counts = coverage(snapshot, num_layers)
        if not watch.min_coverage:
            watch.min_coverage = [None] * num_layers
        for layer, count in enumerate(counts):
            low = watch.min_coverage[layer]
            if low is not None or count > 0:
                watch.min_coverage[layer] = count if low is None else min(low, count)
        for pid, record in snapshot.peers.items():
            watch.ranges_seen.setdefault(pid, set()).add((record.range_start, record.range_end))
        if snapshot.plan is not None:
            epoch = snapshot.plan.epoch
            watch.plan_seen_at.setdefault(epoch, now)
            plan = Plan.from_json(snapshot.plan.plan)
            if set(plan.placement) == set(peer_ids) and _follows(snapshot, plan, peer_ids):
                if watch.followed_at is None or watch.plan is None or watch.plan.placement != plan.placement:
                    watch.plan, watch.followed_at, watch.followed_polls = plan, now, 0
                    watch.followed_lag_s = snapshot.fetched_at - snapshot.plan.created_at
                    # The status CLI takes seconds to start on a busy machine: run it while we keep watching.
                    watch.status = watch.status or _start_status(initial_peers)
                # Keep watching: the move must be final, and coverage must hold after it too, over a count of
                # snapshots rather than a span of seconds, which a slow machine fills with fewer.
                watch.followed_polls += 1
                if watch.followed_polls > FINAL_POLLS and watch.status.poll() is not None:
                    return
            elif watch.followed_at is not None:
                watch.unfollowed_polls += 1  # a peer left its planned range, or its record went missing
        await asyncio.sleep(0.3)


def _start_status(initial_peers: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.peer.cli", "status", "--model", "tiny", "--json"]
        + ["--initial-peers", *initial_peers],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "FLOWSWARM_THREADS": "1"},
        cwd=REPO,
        start_new_session=True,
    )


def _status_json(proc: subprocess.Popen[str]) -> dict:  # type: ignore[type-arg]
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)  # type: ignore[no-any-return]


def test_peers_move_to_the_plan_without_a_coverage_gap(tmp_path):
    spec = resolve_model("tiny").spec
    with LocalSwarm(tmp_path, model="tiny") as swarm:
        first = swarm.start_peer("0:3", extra_args=[*FAST, "--no-plan"])
        swarm.start_peer("0:3", extra_args=[*FAST, "--no-plan"], wait=False)
        planner = swarm.start_peer("0:3", extra_args=FAST, wait=False)
        swarm.wait_all_ready(timeout_s=90)
        peer_ids = [p.peer_id for p in swarm.peers]

        async def watch() -> None:
            async with swarm_client(first.maddrs, spec.weights_hash) as (_dht, directory, _p2p):
                await _watch(seen, directory, peer_ids, spec.num_layers, 180, first.maddrs)

        started = time.monotonic()
        seen = Watch()
        try:
            asyncio.run(watch())
        finally:
            if seen.status is not None and seen.status.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    seen.status.wait(60)  # the last check reads its output; never leave it running
                if seen.status.poll() is None:
                    os.killpg(seen.status.pid, signal.SIGKILL)
                    seen.status.wait(10)
        logs = "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in swarm.peers)
        assert seen.plan is not None and seen.followed_at is not None, f"peers never followed a plan:\n{logs}"
        assert seen.status is not None and seen.status.returncode is not None, "status --json did not finish"
        plan = seen.plan
        # Every layer was served at some point (3:6 only after a move), and once served, never dropped.
        assert None not in seen.min_coverage, (seen.min_coverage, seen.ranges_seen, logs)
        assert min(c or 0 for c in seen.min_coverage) >= 1, (seen.min_coverage, seen.ranges_seen, logs)
        assert seen.unfollowed_polls == 0, (seen.ranges_seen, logs)  # once there, every peer stays there
        epoch = max(seen.plan_seen_at)
        print(
            json.dumps(
                {
                    "plan_epoch": epoch,
                    "placement": {pid[-6:]: str(r) for pid, r in plan.placement.items()},
                    "max_flow_tokens_s": round(plan.max_flow_tokens_s, 1),
                    "plan_seen_to_followed_s": round(seen.followed_at - seen.plan_seen_at[epoch], 2),
                    "plan_created_to_followed_s": round(seen.followed_lag_s or 0.0, 2),
                    "watch_s": round(time.monotonic() - started, 1),
                    "polls": seen.polls,
                    "unfollowed_polls": seen.unfollowed_polls,
                    "min_coverage": seen.min_coverage,
                    "ranges_seen": {pid[-6:]: sorted(r) for pid, r in seen.ranges_seen.items()},
                }
            )
        )

        assert seen.status is not None
        status = _status_json(seen.status)
        assert status["planner"] == planner.peer_id
        assert status["plan"]["epoch"] == epoch
        assert status["plan"]["max_flow_tokens_s"] == pytest.approx(plan.max_flow_tokens_s)
        placement = status["plan"]["placement"]
        assert {p["peer_id"]: p["range"] for p in status["peers"] if p["state"] == "serving"} == placement
        # Moves done and no session was open: no peer still serves an older range.
        assert all(p["older_ranges"] == [] for p in status["peers"]), status["peers"]
        assert min(status["coverage"]) >= 1
