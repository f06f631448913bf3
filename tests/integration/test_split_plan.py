"""The two halves of prefill/decode splitting together, with real peers: the elected planner publishes a plan
of two flows (Plan.decode_flows) where that serves more requests, and the client prefills along the prompt
flows and moves each session to the decode flows' route after its prompt.

Four ``swarm-peer`` processes of the tiny model, following the plan (at first p1 0:3, p2 3:6 with a KV cache too
small to decode many sessions, d1 0:3, d2 3:6 with a large one). All compute alike, so on single routes the
big caches' peers spend their time on prompts and tokens both; with the phases apart, the small caches' peers take
prompts (the planner takes any gain here: the test's workload is 5 prompt tokens per output token, a session
decoding at 1000 tokens/s). Greedy tokens equal local transformers'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from client import SwarmClient
from client.chain import RemoteChain
from client.generation import GenerationRequest, generate_ids
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.testing import LocalSwarm, greedy_reference
from swarm.types import Plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 8
SPLIT = [
    "--planner-split-phases",
    *("--planner-split-prompt-tokens-per-output", "5", "--planner-split-session-tokens-s", "1000"),
    *("--planner-split-min-gain", "0"),
]
SETTINGS: dict[str, Any] = dict(step_timeout_s=60.0, route_wait_s=30.0, spot_check_rate=0.0, speculate="off")


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("split-plan"), model="tiny:0") as local:
        local.start_peer("0:3", name="p1", extra_args=[*SPLIT, "--cache-tokens", "64"])
        local.start_peer("3:6", name="p2", extra_args=[*SPLIT, "--cache-tokens", "64"], wait=False)
        for name, layers in (("d1", "0:3"), ("d2", "3:6")):
            local.start_peer(layers, name=name, extra_args=[*SPLIT, "--cache-tokens", "16384"], wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


async def _split_plan(client: SwarmClient) -> Plan:
    """The first plan with decode flows that the client reads (the planner publishes it once all four joined),
    once every peer serves the layers it places there."""
    async with asyncio.timeout(180):
        while True:
            snapshot = await client.aclient.routes.snapshot(force=True)
            plan = snapshot.plan.to_plan() if snapshot.plan is not None else None
            if plan is not None and plan.decode_flows and len(snapshot.peers) == 4:
                held = {pid: (r.range_start, r.range_end) for pid, r in snapshot.peers.items()}
                if all(held.get(pid) == (r.start, r.end) for pid, r in plan.placement.items()):
                    return plan
            await asyncio.sleep(
                0.5
            )  # the planner publishes, and peers move, on their own schedule: poll the DHT


def test_the_planners_split_plan_moves_sessions_from_prompt_to_decode_peers(
    swarm: LocalSwarm, expected: list[int]
) -> None:
    names = {p.peer_id: p.name for p in swarm.peers}
    with SwarmClient(swarm.initial_peers, model="tiny:0", **SETTINGS) as client:
        plan = client.run(_split_plan(client))
        decode_peers = {names[f.dst] for f in plan.decode_flows if f.dst in names}
        prompt_peers = {names[f.dst] for f in plan.flows if f.dst in names}
        assert decode_peers and prompt_peers
        chain = client.aclient.chain
        assert isinstance(chain, RemoteChain)
        steps: list[tuple[tuple[str, ...], int]] = []  # (peer names, tokens) of each step sent
        step = chain.step

        async def recorded(
            session_id: Any, stages: Any, position: int, hidden: Any, *a: Any, **k: Any
        ) -> Any:
            steps.append((tuple(names[str(s.peer_id)] for s in stages), int(hidden.shape[0])))
            return await step(session_id, stages, position, hidden, *a, **k)

        chain.step = recorded  # type: ignore[method-assign]

        async def one() -> tuple[list[int], set[str]]:
            session = client.aclient.new_session(len(PROMPT_IDS) + NEW_TOKENS)
            request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())
            try:
                tokens = [t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)]
            finally:
                await session.close()
            return tokens, {names[str(m.target)] for m in session.moves if not m.error}

        # Routes come by weighted round-robin over each phase's flows: a session whose decode route is not
        # where it prefilled moves there after its prompt
        for _ in range(12):
            steps.clear()
            tokens, moved = client.run(one())
            assert tokens == expected
            prompt_route, decode_routes = steps[0][0], {r for r, n in steps[1:] if n == 1}
            if moved:
                break
        else:
            placement = {names.get(p, p): str(r) for p, r in plan.placement.items()}
            pytest.fail(f"no session moved after its prompt in 12: plan {placement}, {plan.decode_flows}")
    # it decoded on one route other than where it prefilled: its stages moved to peers the decode flows go
    # through (a stage whose decode peer was taken by an earlier stage stays where it prefilled)
    assert len(decode_routes) == 1 and decode_routes != {prompt_route}
    assert moved <= decode_peers and moved <= set(next(iter(decode_routes)))
    assert set(next(iter(decode_routes))) <= moved | set(prompt_route)
    assert all(n == 1 for _, n in steps[1:])
