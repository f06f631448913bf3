"""Visitors who go away: `swarm-chat` stops their generations and frees their sessions on every peer.

A real swarm of two default-model peers and a real `swarm-chat` process, which runs 4 generations at once and
queues the rest. A real HTTP client (aiohttp's) sends streamed requests and drops them after their first chunk,
plain requests with long prompts and drops them while their prompt is on its way through the peers (a raw
connection closed after writing the request), and more
than run at once, so some are dropped while queued. Each would take far longer than the test waits if it went
on; a session left open would stay for the peers' idle timeout (120 s).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from swarm.testing import LocalSwarm
from swarm.testing.chat import ChatServer

pytestmark = pytest.mark.integration

MAX_TOKENS = 1500  # far more than the swarm makes in the time the test waits


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("dropped")
    with LocalSwarm(work, model="default") as swarm:
        swarm.start_peer(layers="0:15", name="peer-a", extra_args=["--no-follow-plan"])
        swarm.start_peer(layers="15:30", name="peer-b", wait=False, extra_args=["--no-follow-plan"])
        swarm.wait_all_ready(timeout_s=180)
        flags = ["--max-concurrent-generations", "4", "--max-queued-generations", "16"]
        flags += ["--max-tokens-limit", str(MAX_TOKENS), "--rate-limit-burst", "100"]
        with ChatServer(swarm.initial_peers, work / "chat.log", extra_args=flags) as server:
            yield server.url


def _status(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "api/status", timeout=30) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


async def _streamed_dropped_after_first_chunk(http: aiohttp.ClientSession, base: str, i: int) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"Tell me a long story number {i}."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    async with http.post(base + "v1/chat/completions", json=body) as response:
        assert response.status == 200
        chunks = 0
        async for line in response.content:
            chunks += line.startswith(b"data: ")
            if chunks == 2:  # the role chunk and the first text
                break
    # leaving the block before the body ended closes the connection


async def _plain_dropped(base: str, i: int, after_s: float) -> None:
    """A whole plain request written on a connection of its own, which is closed ``after_s`` later: a visitor
    whose tab closed while the prompt was still on its way through the peers."""
    host, port = base.split("//")[1].rstrip("/").split(":")
    body = json.dumps({"model": "default", "prompt": f"Item {i}: " + "word " * 400, "max_tokens": MAX_TOKENS})
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    await writer.drain()
    await asyncio.sleep(after_s)
    assert not reader.at_eof()  # no answer yet: the generation is running or queued
    writer.close()
    await writer.wait_closed()


@pytest.mark.timeout(300)
def test_dropped_requests_stop_their_generations_and_free_every_peer(base: str) -> None:
    recorded_before = len(_status(base)["recent_requests"])

    async def drop_all() -> None:
        # force_close: one connection per request, closed when it is dropped (no pool keeping it alive)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            await asyncio.gather(
                *(_streamed_dropped_after_first_chunk(http, base, i) for i in range(4)),
                *(_plain_dropped(base, i, after_s=0.05 * (i % 4)) for i in range(12)),  # some queued
            )

    asyncio.run(drop_all())
    deadline = time.monotonic() + 30
    while True:
        status = _status(base)
        server, peers = status["server"], status["peers"]
        idle = server["active_generations"] == 0 and server["queued_generations"] == 0
        if idle and all(p["live"] and p["active_sessions"] == 0 for p in peers):
            break
        assert time.monotonic() < deadline, f"still busy 30 s after every visitor left: {server}, {peers}"
        time.sleep(0.5)
    assert all(p["free_cache_tokens"] == p["cache_tokens_total"] for p in peers)
    ran = status["recent_requests"][recorded_before:]
    assert len(ran) >= 4  # at least the streamed ones ran; those dropped while queued never started
    assert all(r["finish_reason"] == "cancelled" and r["completion_tokens"] < MAX_TOKENS for r in ran)
