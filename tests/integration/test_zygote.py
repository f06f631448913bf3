"""The zygote that test swarms fork their peers from (swarm/testing/zygote.py) behaves like a fresh process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from swarm.testing.launcher import REPO, LocalSwarm
from swarm.testing.zygote import zygote


@pytest.mark.timeout(120)
def test_bad_arguments_exit_with_argparse_code_and_message_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    child = zygote().start(["join", "--no-such-option"], dict(os.environ), REPO, log)
    assert child.wait(timeout=60) == 2
    assert "unrecognized arguments: --no-such-option" in log.read_text()
    assert child.poll() == 2  # asked again: the code is kept


@pytest.mark.timeout(180)
def test_a_forked_peer_serves_in_its_own_session_and_leaves_cleanly_on_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWSWARM_FORK_PEERS", "1")
    with LocalSwarm(tmp_path) as swarm:
        peer = swarm.start_peer(layers="0:2", timeout_s=120)
        pid = peer.proc.pid
        assert peer.proc.poll() is None
        assert os.getsid(pid) == pid  # leads its own session, as Popen(start_new_session=True) makes it
        assert psutil.Process(pid).children(recursive=True)  # its DHT child (and p2pd)
        assert "serving layers 0:2" in peer.log_tail()
        os.kill(pid, signal.SIGTERM)
        assert peer.proc.wait(timeout=60) == 0, peer.log_tail()
        assert "left the swarm" in peer.log_tail()
