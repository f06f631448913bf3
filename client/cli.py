"""`python -m client.cli --initial-peers MADDR "question"`: stream one answer from a swarm to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from client.client import SwarmClient
from swarm import config as swarm_config
from swarm.routing import route_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m client.cli", description="Ask a FlowSwarm swarm a question."
    )
    parser.add_argument("prompt", help="the question (sent as one user message with the chat template)")
    parser.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="peers to join via"
    )
    parser.add_argument("--model", default="default", help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=swarm_config.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )

    began = time.perf_counter()
    with SwarmClient(args.initial_peers, model=args.model) as swarm:
        print(f"[client] connected in {time.perf_counter() - began:.1f} s", file=sys.stderr)
        request = (
            {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
        )
        began = time.perf_counter()
        for piece in swarm.stream(
            **request, max_new_tokens=args.max_new_tokens, temperature=args.temperature
        ):
            print(piece, end="", flush=True)
        print()
        session = swarm.aclient.last_session
        route = route_text(session.stages) if session else "?"
        print(f"[client] answered in {time.perf_counter() - began:.1f} s; route {route}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
