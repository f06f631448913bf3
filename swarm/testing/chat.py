"""Run `swarm-chat` as a child process (for the demo, tests and benchmarks), and always reap it.

    with ChatServer(swarm.initial_peers, log_path=tmp / "chat.log") as server:
        print(server.url)          # http://127.0.0.1:PORT/ , read from the server's "serving" line
        ask(server.url, "What is the capital of France?")

The server runs in its own process group, so its hivemind DHT child and p2pd go with it on stop.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from swarm.testing.launcher import REPO, log_tail, stop_process_group

READY = re.compile(r"swarm-chat: serving (http://\S+/) ")


class ChatServer:
    """`python -m client.web` on 127.0.0.1 with a free port (unless `port` is given)."""

    def __init__(
        self,
        initial_peers: Sequence[str],
        log_path: Path,
        model: str = "default",
        port: int = 0,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        wait: bool = True,
    ) -> None:
        args = [sys.executable, "-m", "client.web", "--initial-peers", *initial_peers, "--model", model]
        args += ["--host", "127.0.0.1", "--port", str(port), *extra_args]
        self.log_path = log_path
        environment = {**os.environ, "FLOWSWARM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=REPO, start_new_session=True
            )
        self.url = ""
        if wait:
            self.wait_ready(timeout_s)

    def log_tail(self, chars: int = 3000) -> str:
        return log_tail(self.log_path, chars)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """The base URL once the server listens (stops it and raises if it died or took too long)."""
        try:
            self.url = self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            found = READY.search(self.log_tail(100_000))
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"swarm-chat exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"swarm-chat not serving after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; the whole process group is killed at the end."""
        return stop_process_group(self.proc, grace_s)

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def stream_chat(
    base_url: str, model: str, messages: list[dict[str, str]], timeout_s: float = 300.0, **fields: object
) -> Iterator[str]:
    """Text pieces of a streamed /v1/chat/completions answer, with the standard library only."""
    body = json.dumps({"model": model, "messages": messages, "stream": True, **fields}).encode()
    request = urllib.request.Request(
        base_url.rstrip("/") + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    yield choice["delta"]["content"]
