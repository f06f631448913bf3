"""Reads the links the peers announce, from a host's namespace of an emulated network (test_wan_links.py):

    python -m tests.integration.wan_links --initial-peers MADDR --model-hash HASH --peers 2 --wait-s 120

prints one JSON line once every peer announces links to all the others (or at the deadline):
{peer id: {other id: [rtt_s, bandwidth_bytes_s, reverse_bandwidth_bytes_s]}}."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from swarm.testing import swarm_client


async def links(initial_peers: list[str], model_hash: str, peers: int, wait_s: float) -> dict[str, object]:
    async with swarm_client(initial_peers, model_hash) as (_dht, directory, _p2p):
        deadline = time.monotonic() + wait_s
        while True:
            records = (await directory.snapshot()).serving()
            found = {
                pid: {
                    o: [m.rtt_s, m.bandwidth_bytes_s, m.reverse_bandwidth_bytes_s] for o, m in r.links.items()
                }
                for pid, r in records.items()
            }
            complete = len(found) == peers and all(len(v) == peers - 1 for v in found.values())
            if complete or time.monotonic() > deadline:
                return found
            await asyncio.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--model-hash", required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--wait-s", type=float, default=120.0)
    args = parser.parse_args()
    found = asyncio.run(links(args.initial_peers, args.model_hash, args.peers, args.wait_s))
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
