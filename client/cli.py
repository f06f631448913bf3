"""`python -m client.cli --initial-peers MADDR "question"`: stream one answer from a swarm to the terminal.

`--prompt-ids 5,17,42 --json` instead generates greedily after those token ids and prints one JSON line
{"tokens": [...], "route": [peer ids]} (for tests and benchmarks that run the client in a process of its own).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from client.client import SwarmClient
from swarm import config as swarm_config
from swarm.models import SamplingParams
from swarm.routing import route_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m client.cli", description="Ask a FlowSwarm swarm a question."
    )
    parser.add_argument(
        "prompt", nargs="?", default="", help="the question (sent as one user message with the chat template)"
    )
    parser.add_argument(
        "--prompt-ids", default="", help="comma-separated token ids to continue greedily instead"
    )
    parser.add_argument("--json", action="store_true", help="with --prompt-ids: print the tokens as JSON")
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

    if args.prompt_ids:
        return _generate_ids(args)
    if not args.prompt:
        parser.error("give a prompt, or --prompt-ids")
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


def _generate_ids(args: argparse.Namespace) -> int:
    ids = [int(token) for token in args.prompt_ids.split(",")]
    with SwarmClient(args.initial_peers, model=args.model) as swarm:
        tokens = swarm.generate_ids(ids, args.max_new_tokens, SamplingParams(temperature=args.temperature))
        session = swarm.aclient.last_session
        route = [str(stage.peer_id) for stage in session.stages] if session else []
    if args.json:
        print(json.dumps({"tokens": list(tokens), "route": route}), flush=True)
    else:
        print(" ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
