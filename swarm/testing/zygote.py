"""Start ``swarm-peer`` processes by forking one that has already imported torch, transformers and hivemind:
the test side (the zygote process itself is ``swarm/peer/zygote.py``).

A fresh ``python -m swarm.peer.cli`` spends most of its start-up CPU importing before it does anything
(docs/benchmarks.md). Tests and their benchmark smoke runs start ~100 peers, so on 2 cores the imports were
more than half the suite's CPU. The zygote is a process started once per
test process that imports those modules and then, for each request, forks a child that runs
``swarm.peer.cli.main`` with the requested arguments, environment, working directory and log file: the same
code, now in a process that only copies its parent's imported modules on write.

It stays for tests (``FLOWSWARM_FORK_PEERS``, set by ``scripts/test``): a user's ``swarm-peer join`` and the
benchmarks run by hand start fresh, so a measured join time includes the imports a user waits for.

Protocol: one JSON object a line on the zygote's stdin, one answer a line on its stdout:
``{"start": {"argv", "env", "cwd", "log"}}`` -> ``{"pid"}``, ``{"poll": pid}`` -> ``{"code": int | null}``.
Each child leads its own session (like ``Popen(start_new_session=True)``); the zygote, its parent, reaps it
and keeps its exit code for ``poll``. The zygote exits when its stdin closes (its test process ended).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_POLL_INTERVAL_S = 0.05


class ForkedProcess:
    """The part of ``subprocess.Popen`` that the launcher and tests use, for a child of the zygote."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(_POLL_INTERVAL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not after it was reaped: its pid may be another process's by now
            os.kill(self.pid, sig)


class Zygote:
    """The client side: starts the zygote process and talks to it (one request at a time, any thread)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.peer.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._lock = threading.Lock()

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        """Fork a child running ``swarm.peer.cli.main(argv)``; its output goes to ``log``."""
        answer = self._ask({"start": {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}})
        return ForkedProcess(self, int(answer["pid"]))

    def poll(self, pid: int) -> int | None:
        code = self._ask({"poll": pid})["code"]
        return None if code is None else int(code)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited with {self._proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the zygote could not {next(iter(request))}: {answer['error']}")
        return answer


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use and closed at exit."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote
