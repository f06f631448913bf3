"""A hop that skips the rest of its route, on real processes: ``skipper`` (layers 0:3) is started with
``--faulty-skip-rate 1.0``, so whenever it should forward a step it returns its own output instead, with made-up
timings for the hops after it. Alone it computes honestly, so a check of one stage against another holder never
catches it; the route check does. ``tail`` holds 3:6 and ``whole`` holds 0:6 (a substitute for either stage).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from client import AsyncSwarmClient, SwarmClient
from client.generation import GenerationRequest, generate_ids
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Stage
from swarm.testing import LocalSwarm, greedy_reference
from swarm.types import LayerRange, NodeID
from tests.integration.test_spot_check import Reports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 8
FIXED = ["--no-follow-plan", "--no-plan"]


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("spot_route"), model="tiny:0") as local:
        local.start_peer("0:6", name="whole", extra_args=FIXED)
        local.start_peer("0:3", name="skipper", extra_args=[*FIXED, "--faulty-skip-rate", "1.0"], wait=False)
        local.start_peer("3:6", name="tail", extra_args=FIXED, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


def _peer(swarm: LocalSwarm, name: str) -> NodeID:
    return NodeID(next(p.peer_id for p in swarm.peers if p.name == name))


async def _through(client: AsyncSwarmClient, route: tuple[Stage, ...]) -> list[int]:
    """Greedy tokens of a session whose first route is `route`, as if the router had picked it."""
    session = client.new_session(len(PROMPT_IDS) + NEW_TOKENS)
    session.stages = route
    request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, client.eos_ids)
    try:
        return [t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)]
    finally:
        await session.close()


def test_a_hop_that_skips_the_rest_of_its_route_is_caught_and_excluded_and_output_stays_exact(
    swarm: LocalSwarm, expected: list[int], capsys: Any
) -> None:
    skipper, tail = _peer(swarm, "skipper"), _peer(swarm, "tail")
    route = (Stage(skipper, LayerRange(0, 3)), Stage(tail, LayerRange(3, 6)))
    reports = Reports()
    with SwarmClient(
        swarm.initial_peers,
        model="tiny:0",
        reports=reports,
        spot_check_rate=1.0,
        spot_check_blocking=True,
        spot_check_seed=0,
    ) as client:
        checker = client.aclient.checker
        assert client.run(_through(client.aclient, route)) == expected
        session = client.aclient.last_session
        assert session is not None and session.failovers == 1
        assert skipper not in {s.peer_id for s in session.stages}
        assert checker.excluded == {skipper}  # the hop it skipped is not blamed
        assert reports.sent == [(skipper, LayerRange(0, 3))]
        served = checker.steps_served[skipper]
        assert served == 1  # the prefill, whose check caught it; its output was never used
        for _ in range(2):  # later sessions never go through it
            assert client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()) == expected
        assert checker.steps_served[skipper] == 1
        with capsys.disabled():
            print(f"\nskipper served {served} step(s) before the client stopped routing to it")
