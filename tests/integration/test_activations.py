"""Activation codecs (swarm.codec) on real ``swarm-peer`` processes of the tiny model, layers 0:2, 2:4, 4:6.

With every hop in q8 (the peers' ``--activations q8``, the client's too), sessions are served end to end: the
tokens come (they may differ from exact ones), several sessions' steps go on together, the peers log that
their states went as q8, and a spot-check of every step, whose route check runs lossless, blames no honest
peer. With the defaults, the same swarm layout answers exactly like local transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SwarmClient
from swarm.codec import ActivationConfig
from swarm.models.head import SamplingParams
from swarm.models.loading import ModelSource
from swarm.testing import LocalSwarm, greedy_reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 12
FIXED = ["--no-follow-plan"]


def _swarm(path: Path, extra_args: list[str]) -> LocalSwarm:
    local = LocalSwarm(path, model="tiny:0")
    try:
        local.start_peer("0:2", name="first", extra_args=FIXED + extra_args)
        local.start_peer("2:4", name="middle", extra_args=FIXED + extra_args, wait=False)
        local.start_peer("4:6", name="last", extra_args=FIXED + extra_args, wait=False)
        local.wait_all_ready(timeout_s=120)
    except BaseException:
        local.close()
        raise
    return local


@pytest.fixture
def q8_swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with _swarm(tmp_path, ["--activations", "q8"]) as local:
        yield local


@pytest.fixture
def exact_swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with _swarm(tmp_path, []) as local:
        yield local


def test_a_swarm_in_q8_serves_sessions_end_to_end(q8_swarm: LocalSwarm, tiny_source: ModelSource) -> None:
    settings = dict(spot_check_rate=1.0, spot_check_blocking=True, step_timeout_s=60.0, probe_timeout_s=10.0)
    q8 = ActivationConfig(mode="q8")
    with SwarmClient(q8_swarm.initial_peers, model="tiny:0", activations=q8, **settings) as client:
        rows = client.generate_ids_batch(PROMPTS, NEW_TOKENS, SamplingParams())
        checker = client.aclient.checker
        assert checker.checks_run > 0 and not checker.excluded and not checker.avoided_pairs
    vocab = tiny_source.spec.vocab_size
    assert [len(row) for row in rows] == [NEW_TOKENS] * len(PROMPTS)
    assert all(0 <= token < vocab for row in rows for token in row)
    logs = {p.name: p.log_path.read_text() for p in q8_swarm.peers}
    assert "go as q8" in logs["first"] and "go as q8" in logs["middle"], "the peers forwarded in q8"


def test_the_default_stays_exact(exact_swarm: LocalSwarm, tiny_source: ModelSource) -> None:
    with SwarmClient(exact_swarm.initial_peers, model="tiny:0", spot_check_rate=0.0) as client:
        rows = client.generate_ids_batch(PROMPTS, NEW_TOKENS, SamplingParams())
    assert rows == [greedy_reference(tiny_source, prompt, NEW_TOKENS) for prompt in PROMPTS]
    logs = {p.name: p.log_path.read_text() for p in exact_swarm.peers}
    assert "go as exact" in logs["first"] and "go as q8" not in logs["first"]
