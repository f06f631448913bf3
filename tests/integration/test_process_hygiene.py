"""A SIGKILLed peer leaves no process behind: its hivemind DHT child and the p2pd daemon go with it."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from swarm.testing import LocalSwarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Poll until every process has exited (zombies count as gone); the ones still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


def test_a_sigkilled_peer_takes_its_dht_child_and_p2pd_with_it(tmp_path) -> None:
    with LocalSwarm(tmp_path) as swarm:
        peer = swarm.start_peer("0:6", extra_args=["--no-plan", "--no-follow-plan"])
        descendants = psutil.Process(peer.proc.pid).children(recursive=True)
        names = [p.name() for p in descendants]
        assert any("p2pd" in n for n in names), f"expected a p2pd among the peer's descendants: {names}"
        os.kill(peer.proc.pid, signal.SIGKILL)  # the peer alone, not its process group
        peer.proc.wait(timeout=10)
        left = _wait_gone(descendants, timeout_s=30)
        assert not left, f"still running after the peer was SIGKILLed: {[(p.pid, p.name()) for p in left]}"
