"""A client in a host's namespace of an emulated network with one slow link (test_wan_slow_link.py; also the
recipe for bench_wan's slow-link figures):

    python -m tests.integration.wan_slow_link --initial-peers MADDR --model tiny:0 --slow P1_ID P3_ID

waits until every serving peer announces its links to all the others and a plan is published, gives the
planner `--settle-s` to re-flow, then prints one JSON line: the plan's share of flow over the slow link, and the share of sessions
routed over it, lone (opened and closed one by one) and together (8 open at once)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from client import SwarmClient
from client.client import AsyncSwarmClient
from swarm.planner import link_flow_share
from swarm.routing import Route, link_session_share
from swarm.types import NodeID


async def _links_complete(client: AsyncSwarmClient, peers: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        records = (await client.routes.snapshot(force=True)).serving()  # type: ignore[attr-defined]
        if len(records) == peers and all(len(r.links) == peers - 1 for r in records.values()):
            return
        await asyncio.sleep(1.0)
    raise TimeoutError(f"peers did not announce their links within {wait_s} s")


async def _plan_published(client: AsyncSwarmClient, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while (await client.routes.snapshot(force=True)).plan is None:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan published within {wait_s} s")
        await asyncio.sleep(1.0)


async def _routes(client: AsyncSwarmClient, together: int, rounds: int) -> list[Route]:
    routes: list[Route] = []
    for _ in range(rounds):
        sessions = [client.new_session(64) for _ in range(together)]
        for session in sessions:  # opened one after another, the earlier ones still open
            await session.open()
        routes += [session.stages for session in sessions]
        for session in sessions:
            await session.close()
    return routes


async def measure(
    client: AsyncSwarmClient, slow: tuple[NodeID, NodeID], peers: int, settle_s: float
) -> dict[str, object]:
    await _links_complete(client, peers, 120.0)
    await _plan_published(client, 120.0)  # the planner's lease and first solve may come after the links
    await asyncio.sleep(settle_s)  # time to re-flow on the links as measured
    snapshot = await client.routes.snapshot(force=True)  # type: ignore[attr-defined]
    if snapshot.plan is None:
        raise RuntimeError("the plan was withdrawn")
    plan = snapshot.plan.to_plan()
    lone = await _routes(client, 1, 16)
    together = await _routes(client, 8, 4)
    a, b = slow  # the link is slow both ways, and the plan may place either end first: count both
    return {
        "epoch": plan.epoch,
        "placement": {p: str(r) for p, r in plan.placement.items()},
        "slow_link_flow_share": link_flow_share(plan, a, b) + link_flow_share(plan, b, a),
        "slow_link_session_share_lone": link_session_share(lone, a, b) + link_session_share(lone, b, a),
        "slow_link_session_share_8": link_session_share(together, a, b) + link_session_share(together, b, a),
        "routes_8": [[s.peer_id for s in r] for r in together],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--slow", nargs=2, required=True, metavar=("SRC", "DST"))
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=15.0)
    args = parser.parse_args()
    slow = (NodeID(args.slow[0]), NodeID(args.slow[1]))
    with SwarmClient(args.initial_peers, model=args.model, step_timeout_s=30.0) as client:
        found = client.run(measure(client.aclient, slow, args.peers, args.settle_s))
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
