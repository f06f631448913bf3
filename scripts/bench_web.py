#!/usr/bin/env python
"""What the web server adds: a streamed chat answer through swarm-chat's OpenAI API next to AsyncSwarmClient.

Starts three `swarm-peer join` processes of the default model on 127.0.0.1 (layers 0:10, 10:20, 20:30, fixed)
and `swarm-chat` in front of them, and connects an AsyncSwarmClient in this process to the same swarm. Then,
--repeats times and alternating (so the shared machine's noise falls on both alike), streams the same greedy
answer (--new-tokens tokens, a prompt long answers follow) once through POST /v1/chat/completions with
`stream: true` and once with AsyncSwarmClient.stream. Per run: time to first token = request sent to first
text received; tokens/s = (tokens - 1) / (last text - first text). Prints ONE JSON object with the medians,
the best runs, and the server's overhead in percent (positive = the API is slower).

Wall times on this shared 2-core machine vary by more than the few percent the server adds, so the benchmark
also reports the server's cost in CPU, which is not disturbed by other jobs: the CPU seconds the swarm-chat
process spent per API answer minus the CPU seconds this process spent per client answer (both run the same
AsyncSwarmClient; the difference is the web layer), as a percent of one answer's wall time
(`cpu_overhead_percent_of_answer`).

    .venv/bin/python scripts/bench_web.py                     # 64 tokens, 5 repeats
    .venv/bin/python scripts/bench_web.py --new-tokens 8 --repeats 1   # quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["FLOWSWARM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp
import psutil

from client import AsyncSwarmClient
from swarm.testing import LocalSwarm
from swarm.testing.chat import ChatServer

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


class Run:
    """Times of one streamed answer."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.first: float | None = None
        self.last = self.began
        self.text: list[str] = []

    def piece(self, text: str) -> None:
        now = time.perf_counter()
        self.first = now if self.first is None else self.first
        self.last = now
        self.text.append(text)

    def figures(self, tokens: int) -> dict[str, float]:
        assert self.first is not None, "no text arrived"
        decode_s = self.last - self.first
        return {
            "ttft_s": self.first - self.began,
            "tokens_s": (tokens - 1) / decode_s if decode_s > 0 else 0.0,
        }


async def through_api(
    http: aiohttp.ClientSession, url: str, new_tokens: int
) -> tuple[str, int, dict[str, float]]:
    body = {
        "model": "default", "messages": MESSAGES, "stream": True, "temperature": 0, "max_tokens": new_tokens,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    run, tokens = Run(), 0
    async with http.post(url + "v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    run.piece(choice["delta"]["content"])
    return "".join(run.text), tokens, run.figures(tokens)


async def through_client(
    client: AsyncSwarmClient, new_tokens: int, tokens: int
) -> tuple[str, dict[str, float]]:
    run = Run()
    async for piece in client.stream(messages=MESSAGES, max_new_tokens=new_tokens, temperature=0.0):
        run.piece(piece)
    return "".join(run.text), run.figures(tokens)


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {
        "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
        "tokens_s_median": statistics.median(r["tokens_s"] for r in runs),
        "ttft_s_best": min(r["ttft_s"] for r in runs),
        "tokens_s_best": max(r["tokens_s"] for r in runs),
    }


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def measure(
    initial_peers: list[str], url: str, new_tokens: int, repeats: int, server_pid: int
) -> dict[str, object]:
    server, me = psutil.Process(server_pid), psutil.Process()
    api_cpu_s = client_cpu_s = client_wall_s = 0.0
    client = await AsyncSwarmClient.create(initial_peers, "default")
    try:
        async with aiohttp.ClientSession() as http:
            await through_api(http, url, 4)  # warm both paths: first-request costs are not the server's
            await client.generate(messages=MESSAGES, max_new_tokens=4)
            api_runs, client_runs, tokens = [], [], 0
            for _ in range(repeats):
                before = _cpu_s(server)
                api_text, tokens, api = await through_api(http, url, new_tokens)
                api_cpu_s += _cpu_s(server) - before
                before, began = _cpu_s(me), time.perf_counter()
                client_text, direct = await through_client(client, new_tokens, tokens)
                client_cpu_s += _cpu_s(me) - before
                client_wall_s += time.perf_counter() - began
                if api_text != client_text:
                    raise AssertionError(f"the API answered {api_text!r}, the client {client_text!r}")
                api_runs.append(api)
                client_runs.append(direct)
    finally:
        await client.close()
    api_sum, client_sum = summary(api_runs), summary(client_runs)
    return {
        "tokens": tokens,
        "repeats": repeats,
        "api": api_sum,
        "client": client_sum,
        "overhead_percent": {
            "ttft_median": 100 * (api_sum["ttft_s_median"] / client_sum["ttft_s_median"] - 1),
            "tokens_s_median": 100 * (client_sum["tokens_s_median"] / api_sum["tokens_s_median"] - 1),
            "ttft_best": 100 * (api_sum["ttft_s_best"] / client_sum["ttft_s_best"] - 1),
            "tokens_s_best": 100 * (client_sum["tokens_s_best"] / api_sum["tokens_s_best"] - 1),
        },
        "cpu_s_per_answer": {"server": api_cpu_s / repeats, "client": client_cpu_s / repeats},
        "cpu_overhead_percent_of_answer": 100 * (api_cpu_s - client_cpu_s) / client_wall_s,
        "runs": {"api": api_runs, "client": client_runs},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_web.") as tmp:
        work = Path(tmp)
        with LocalSwarm(work, model="default") as swarm:
            for i, layers in enumerate(("0:10", "10:20", "20:30")):
                swarm.start_peer(layers, name=f"peer-{i}", wait=i == 0, extra_args=["--no-follow-plan"])
            swarm.wait_all_ready(timeout_s=300)
            with ChatServer(swarm.initial_peers, work / "chat.log", timeout_s=300) as server:
                result = asyncio.run(
                    measure(swarm.initial_peers, server.url, args.new_tokens, args.repeats, server.proc.pid)
                )
    text = json.dumps({"benchmark": "bench_web", "model": "default", **result}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
