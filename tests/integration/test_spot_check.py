"""A lying peer on real processes: two ``swarm-peer`` processes hold every layer of the tiny model, one of them
started with ``--faulty-output-rate 1.0`` (noise on every output it returns). A client that spot-checks every
step catches it, stops routing to it and still answers exactly like local transformers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from client import AsyncSwarmClient, SwarmClient
from client.generation import GenerationRequest, generate_ids
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Stage
from swarm.testing import LocalSwarm, greedy_reference, swarm_client
from swarm.types import LayerRange, NodeID

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 8
FIXED = ["--no-follow-plan"]  # both keep all six layers whatever the plan says


class Reports:
    def __init__(self) -> None:
        self.sent: list[tuple[NodeID, LayerRange]] = []

    async def report(self, accused_peer_id: NodeID, layers: LayerRange, reason: str) -> None:
        self.sent.append((accused_peer_id, layers))


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("spot"), model="tiny:0") as local:
        local.start_peer("0:6", name="honest", extra_args=FIXED)
        local.start_peer("0:6", name="liar", extra_args=[*FIXED, "--faulty-output-rate", "1.0"], wait=False)
        local.wait_all_ready(timeout_s=90)
        yield local


async def _through(client: AsyncSwarmClient, peer: NodeID) -> list[int]:
    """Greedy tokens of a session whose first route is `peer` alone, as if the router had picked it."""
    session = client.new_session(len(PROMPT_IDS) + NEW_TOKENS)
    session.stages = (Stage(peer, LayerRange(0, 6)),)
    request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, client.eos_ids)
    try:
        return [t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)]
    finally:
        await session.close()


def test_a_lying_peer_is_caught_and_excluded_and_greedy_output_stays_exact(
    swarm: LocalSwarm, expected: list[int], capsys: Any
) -> None:
    liar = NodeID(next(p.peer_id for p in swarm.peers if p.name == "liar"))
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
        # The router may pick either holder first (and a liar met as the checker is caught too, see
        # tests/unit/client/test_spot.py); here the first session is sent through the liar on purpose.
        assert client.run(_through(client.aclient, liar)) == expected
        session = client.aclient.last_session
        assert (
            session is not None and session.failovers == 1 and liar not in {s.peer_id for s in session.stages}
        )
        assert checker.excluded == {liar}
        assert reports.sent == [(liar, LayerRange(0, 6))]
        served = checker.steps_served[liar]
        assert served == 1  # the prefill, whose check caught it; its output was never used
        # later sessions never go through it
        for _ in range(2):
            assert client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()) == expected
            session = client.aclient.last_session
            assert session is not None and liar not in {s.peer_id for s in session.stages}
        assert checker.steps_served[liar] == 1
        with capsys.disabled():
            print(f"\nliar served {served} step(s) before the client stopped routing to it")


def test_a_caught_liar_is_reported_in_the_dht_under_the_clients_key(swarm: LocalSwarm) -> None:
    """With no sink given, the client publishes a signed report that every reader of the swarm sees."""
    liar = NodeID(next(p.peer_id for p in swarm.peers if p.name == "liar"))
    with SwarmClient(
        swarm.initial_peers, model="tiny:0", spot_check_rate=1.0, spot_check_blocking=True, spot_check_seed=1
    ) as client:
        client.run(_through(client.aclient, liar))
        assert client.aclient.checker.excluded == {liar}
        reporter = client.aclient.dht.peer_id if client.aclient.dht is not None else None

        async def reporters() -> set[str]:
            model_hash = client.aclient.chain.model_hash  # type: ignore[attr-defined]
            async with swarm_client(swarm.initial_peers, model_hash) as (_dht, directory, _p2p):
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    found = (await directory.snapshot()).reports.get(str(liar), set())
                    if found:
                        return set(found)
                    await asyncio.sleep(0.5)
            return set()

        assert client.run(reporters()) == {reporter}
