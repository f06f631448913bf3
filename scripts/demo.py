#!/usr/bin/env python
"""The demo's main job (called by ./scripts/demo after set-up): a real local swarm and its web face.

Starts three `swarm-peer join` processes of the default model (SmolLM2-135M-Instruct, layers 0:10, 10:20,
20:30) on 127.0.0.1, each limited to 0.18 GB so the elected planner must split the model across them, then
`swarm-chat` in front of them; asks one question through the OpenAI-compatible API and prints the streamed
answer, prints the chat and status URLs, and serves until Ctrl-C. Everything it started is stopped on the way
out (each child leads its own process group, so DHT children and p2pd daemons go with it).

    .venv/bin/python scripts/demo.py                       # serve on http://127.0.0.1:8000/ until Ctrl-C
    .venv/bin/python scripts/demo.py --once "Name three colours."   # answer one question and exit
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("FLOWSWARM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from swarm.testing import LocalSwarm
from swarm.testing.chat import ChatServer, stream_chat

QUESTION = "What is the capital of France?"
LAYERS = ("0:10", "10:20", "20:30")
# Each peer plays a small consumer GPU that holds at most 12 of the 30 layers (weights plus KV cache), so
# the planner must split the model and hidden states really hop from peer to peer.
PEER_ARGS = ["--max-memory-gb", "0.18"]


def say(text: str) -> None:
    print(f"[demo] {text}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", metavar="QUESTION", help="answer QUESTION through the API and exit")
    parser.add_argument(
        "--port", type=int, default=None, help="chat server port (8000; a free one with --once)"
    )
    args = parser.parse_args(argv)
    port = args.port if args.port is not None else (0 if args.once else 8000)
    # SIGTERM ends the demo like Ctrl-C does: through the `with` blocks below, which stop every child. SIGINT is
    # set too, since a shell starting us in the background leaves it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    with tempfile.TemporaryDirectory(prefix="flowswarm-demo.") as tmp:
        work = Path(tmp)
        try:
            return run(work, args.once, port)
        except KeyboardInterrupt:
            say("stopping everything started here")
            return 130


def run(work: Path, once: str | None, port: int) -> int:
    began = time.perf_counter()
    say(f"starting 3 peers of the default model on 127.0.0.1 (logs in {work})")
    with LocalSwarm(work, model="default") as swarm:
        names = [f"peer-{c}" for c in "abc"]
        swarm.start_peer(LAYERS[0], name=names[0], extra_args=PEER_ARGS, timeout_s=300)
        for name, layers in zip(names[1:], LAYERS[1:], strict=True):
            swarm.start_peer(layers, name=name, extra_args=PEER_ARGS, wait=False)
        swarm.wait_all_ready(timeout_s=300)
        say(f"swarm serving after {time.perf_counter() - began:.0f} s; starting the chat server")
        with ChatServer(swarm.initial_peers, work / "chat.log", port=port, timeout_s=300) as server:
            question = once or QUESTION
            say(f"asking through the OpenAI API ({server.url}v1): {question}")
            asked = time.perf_counter()
            for piece in stream_chat(
                server.url, "default", [{"role": "user", "content": question}], temperature=0
            ):
                print(piece, end="", flush=True)
            print(flush=True)
            say(f"answered in {time.perf_counter() - asked:.1f} s")
            if once:
                return 0
            say(f"chat:   {server.url}")
            say(f"status: {server.url}status")
            say(f"API:    {server.url}v1  (OpenAI-compatible; metrics at {server.url}metrics)")
            say("serving until Ctrl-C")
            while server.proc.poll() is None:
                time.sleep(0.5)
            say(f"the chat server exited with {server.proc.returncode}:\n{server.log_tail()}")
            return 1


if __name__ == "__main__":
    sys.exit(main())
