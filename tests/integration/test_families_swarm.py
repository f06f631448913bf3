"""Gemma 2 and Mixtral on real ``swarm-peer`` processes: tiny random checkpoints (swarm.testing.families) split
over two peers, 0:3 and 3:6. Two concurrent sessions (whose steps a peer may run in one call) answer exactly
like local transformers, well past Gemma 2's 8-token window, and a spot-check of every step, which reruns the
layers without a cache, blames no peer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client import SwarmClient
from swarm.models.head import SamplingParams
from swarm.models.loading import resolve_model
from swarm.testing import LocalSwarm, greedy_reference
from swarm.testing.families import write_tiny_family

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 14
FIXED = ["--no-follow-plan", "--no-plan"]
SEED = 1


@pytest.fixture(scope="module", params=["gemma2", "mixtral"])
def family_swarm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalSwarm, Path]]:
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_tiny_family(root / "checkpoint", request.param, SEED)
    with LocalSwarm(root, model=str(checkpoint)) as local:
        local.start_peer("0:3", name="first", extra_args=FIXED)
        local.start_peer("3:6", name="last", extra_args=FIXED, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local, checkpoint


def test_two_sessions_through_two_peers_equal_transformers(family_swarm: tuple[LocalSwarm, Path]) -> None:
    swarm, checkpoint = family_swarm
    source = resolve_model(str(checkpoint))
    expected = [greedy_reference(source, prompt, NEW_TOKENS) for prompt in PROMPTS]
    settings = dict(spot_check_rate=1.0, spot_check_blocking=True, step_timeout_s=60.0, probe_timeout_s=10.0)
    with SwarmClient(swarm.initial_peers, model=str(checkpoint), **settings) as client:
        rows = client.generate_ids_batch(PROMPTS, NEW_TOKENS, SamplingParams())
        checker = client.aclient.checker
        assert checker.checks_run > 0 and not checker.excluded and not checker.avoided_pairs
    assert rows == expected
    assert all(len(set(row)) > 3 for row in expected)  # answers that a wrong layer would change
