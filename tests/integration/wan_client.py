"""A client in a process of its own, for a host's namespace of an emulated network (test_wan_swarm.py):

    python -m tests.integration.wan_client --initial-peers MADDR --model tiny:0 --prompt-ids 5,17,42 --new-tokens 8

prints one JSON line: the greedy tokens and the route's stages (peer id and layers)."""

from __future__ import annotations

import argparse
import json

from client import SwarmClient
from swarm.models import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--new-tokens", type=int, required=True)
    args = parser.parse_args()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    settings = dict(step_timeout_s=30.0, probe_timeout_s=10.0)
    with SwarmClient(args.initial_peers, model=args.model, **settings) as client:
        tokens = client.generate_ids(prompt, args.new_tokens, SamplingParams())
        session = client.aclient.last_session
        stages = [] if session is None else [[s.peer_id, str(s.layers)] for s in session.stages]
    print(json.dumps({"tokens": tokens, "stages": stages}), flush=True)


if __name__ == "__main__":
    main()
