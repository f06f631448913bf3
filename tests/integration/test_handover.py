"""A peer that leaves gracefully hands its sessions' KV caches to a replica; the client goes on without replay.

Four ``swarm-peer`` processes of the tiny model: first 0:2, mid and mid2 2:4, last 4:6 (nobody follows the
plan). A client generates greedily; after its 4th token the middle peer of its route gets SIGTERM, and the
client's loop waits until that peer's log says it handed the session over (an event of the peer, not a timer).
The answer equals local transformers, nothing was replayed, and the one failover is a FOLLOW to the replica.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from client import SwarmClient
from client.generation import GenerationRequest, generate_ids
from client.retry import Action
from client.session import InferenceSession
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.testing import LocalSwarm, greedy_reference
from swarm.testing.launcher import PeerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 12
FIXED = ["--no-follow-plan", "--record-ttl-s", "6"]
HANDED = re.compile(r"handed session \S+ \((\d+) tokens, (\d+) KV bytes\) over to (\S+) in ([\d.]+) s")


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("handover"), model="tiny:0") as local:
        local.start_peer("0:2", name="first", extra_args=FIXED)
        for name, layers in (("mid", "2:4"), ("mid2", "2:4"), ("last", "4:6")):
            local.start_peer(layers, name=name, extra_args=FIXED, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


def _wait_for_hand_over(peer: PeerProcess, timeout_s: float = 120.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = HANDED.search(peer.log_path.read_text(errors="replace"))
        if found:
            return found
        time.sleep(0.02)  # polling the peer's log: the event we wait for happens in another process
    raise AssertionError(f"peer {peer.name} did not hand its session over:\n{peer.log_tail()}")


def test_a_sigtermed_middle_peer_hands_its_session_to_the_replica_and_nothing_is_replayed(
    swarm: LocalSwarm, expected: list[int]
) -> None:
    settings: dict[str, Any] = dict(step_timeout_s=60.0, route_wait_s=30.0, spot_check_rate=0.0)
    state: dict[str, Any] = {}

    def leave_after_4(session: InferenceSession, n: int) -> None:
        if n == 4:
            mid = next(p for p in swarm.peers if p.maddrs and p.peer_id == session.stages[1].peer_id)
            os.kill(mid.proc.pid, signal.SIGTERM)
            state["mid"], state["handed"] = mid, _wait_for_hand_over(mid)
            state["replayed"], state["resumed_s"] = session.replayed_tokens, time.monotonic()
        if n == 5:
            state["pause_s"] = time.monotonic() - state["resumed_s"]

    async def run(client: SwarmClient) -> tuple[list[int], InferenceSession]:
        session = client.aclient.new_session(len(PROMPT_IDS) + NEW_TOKENS)
        request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())
        tokens: list[int] = []
        try:
            async for token in generate_ids(session, request, Sampler(SamplingParams()).sample):
                tokens.append(token)
                leave_after_4(session, len(tokens))
        finally:
            await session.close()
        return tokens, session

    with SwarmClient(swarm.initial_peers, model="tiny:0", **settings) as client:
        tokens, session = client.run(run(client))
    assert tokens == expected
    mid, handed = state["mid"], state["handed"]
    mid2 = next(p for p in swarm.peers if p.name in ("mid", "mid2") and p is not mid)
    assert int(handed.group(1)) >= len(PROMPT_IDS) + 2  # the prompt and the tokens fed back since
    assert handed.group(3) == mid2.peer_id[-8:]
    assert session.replayed_tokens == state["replayed"] == 0
    assert [(f.error, f.peer, f.action) for f in session.failover_log] == [
        ("SessionMoved", mid.peer_id, Action.FOLLOW)
    ]
    assert session.stages[1].peer_id == mid2.peer_id
    assert mid.proc.wait(timeout=30) == 0, mid.log_tail()
    print(
        f"hand-over: {handed.group(1)} tokens, {handed.group(2)} KV bytes in {handed.group(4)} s; "
        f"client's step after it: {state['pause_s']:.3f} s"
    )
