"""Speculative decoding over real `swarm-peer` processes (tiny model) on 127.0.0.1: drafted tokens go through
the route in one step with the last accepted one, rejected ones are overwritten by the next step, and the
tokens are those of plain greedy decoding by local transformers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from client import SwarmClient
from client.drafting import Speculation
from client.generation import GenerationRequest, generate_ids
from swarm.models import ModelSource, SamplingParams
from swarm.models.head import Sampler
from swarm.models.loading import resolve_model
from swarm.testing import LocalSwarm
from swarm.testing.reference import greedy_reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

FIXED = ["--no-follow-plan"]
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11] * 3  # repeats itself: prompt lookup has something to propose
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny() -> ModelSource:
    torch.set_num_threads(1)
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def reference(tiny: ModelSource) -> list[int]:
    return greedy_reference(tiny, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("speculate"), model="tiny") as local:
        local.start_peer("0:3", name="a", extra_args=FIXED)
        local.start_peer("3:6", name="b", extra_args=FIXED, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


@pytest.fixture(scope="module")
def client(swarm: LocalSwarm) -> Iterator[SwarmClient]:
    settings = dict(step_timeout_s=20.0, speculate="lookup", draft_tokens=4, spot_check_rate=0.0)
    with SwarmClient(swarm.initial_peers, model="tiny", **settings) as swarm_client:
        yield swarm_client


def test_prompt_lookup_over_the_swarm_gives_the_greedy_tokens_with_drafts_accepted(
    client: SwarmClient, reference: list[int]
) -> None:
    assert client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()) == reference
    session = client.aclient.last_session
    assert session is not None and session.speculation is not None
    assert session.speculation.accepted > 0
    assert session.speculation.drafted > session.speculation.accepted  # some were rejected, and overwritten


class WrongDrafts:
    """Drafts the true answer's next tokens, each off by one: never accepted."""

    def __init__(self, answer: Sequence[int]) -> None:
        self.answer = list(answer)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        done = len(history) - len(PROMPT_IDS)
        return [t + 1 for t in self.answer[done : done + k]]


def test_drafts_always_rejected_over_the_swarm_still_give_the_greedy_tokens(
    client: SwarmClient, reference: list[int]
) -> None:
    spec = Speculation(WrongDrafts(reference), 4)
    request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())

    async def run() -> list[int]:
        session = client.aclient.new_session(len(PROMPT_IDS) + NEW_TOKENS)
        try:
            pick = Sampler(SamplingParams()).sample
            return [t async for t in generate_ids(session, request, pick, True, spec)]
        finally:
            await session.close()

    assert client.run(run()) == reference
    assert spec.steps == NEW_TOKENS - 2 and spec.drafted > 0 and spec.accepted == 0
