"""No request fails while the swarm still covers every layer: the client against real peers that fail.

Four ``swarm-peer`` processes of the tiny model hold first 0:2, mid and mid2 2:4, last 4:6 (nobody follows the
plan, records live 6 s so a peer re-announces every 2 s). One client, with an hour-long step timeout, so that no
test here can pass by waiting for it, and no spot-checks (they would add steps to count):

- the only holder of 0:2 refuses one step (a real refusal: the step is sent with a hidden size it must reject)
  and is banned: the answer still completes, through it;
- the middle peer of a live session vanishes (SIGSTOP of its whole process group: its connections stay open
  and nothing answers, as when a machine loses power): a probe finds it, the failover says so, and the answer
  equals local transformers;
- a middle peer is SIGKILLed: failover through its replica, by the error, and it is withdrawn from routing;
- the only holder of 4:6 is SIGKILLed and a new one started only once the client is seen waiting for a route:
  the answer completes, exact.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from client import SwarmClient
from client.generation import GenerationRequest, generate_ids
from client.retry import Action
from client.session import InferenceSession
from swarm.errors import SwarmError
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.testing import LocalSwarm, greedy_reference
from swarm.testing.launcher import PeerProcess
from swarm.types import NodeID

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 16
FIXED = ["--no-follow-plan", "--record-ttl-s", "6"]
HOUR_S = 3600.0


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("churn"), model="tiny:0") as local:
        local.start_peer("0:2", name="first", extra_args=FIXED)
        for name, layers in (("mid", "2:4"), ("mid2", "2:4"), ("last", "4:6")):
            local.start_peer(layers, name=name, extra_args=FIXED, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


@pytest.fixture(scope="module")
def client(swarm: LocalSwarm) -> Iterator[SwarmClient]:
    # probe_timeout_s: a live peer on a busy machine may take a while to answer a probe; one that died never does
    settings: dict[str, Any] = dict(
        step_timeout_s=HOUR_S, route_wait_s=180.0, spot_check_rate=0.0, probe_timeout_s=10.0
    )
    with SwarmClient(swarm.initial_peers, model="tiny:0", **settings) as swarm_client:
        yield swarm_client


def answer(client: SwarmClient, after_token: Callable[[InferenceSession, int], None]) -> list[int]:
    """Greedy tokens of one session; `after_token(session, n)` runs on the client's loop after token n."""

    async def run() -> list[int]:
        session = client.aclient.new_session(len(PROMPT_IDS) + NEW_TOKENS)
        request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())
        tokens: list[int] = []
        try:
            async for token in generate_ids(session, request, Sampler(SamplingParams()).sample):
                tokens.append(token)
                after_token(session, len(tokens))
        finally:
            await session.close()
        return tokens

    return client.run(run())


def peer_of(swarm: LocalSwarm, peer_id: NodeID) -> PeerProcess:
    return next(p for p in swarm.peers if p.maddrs and p.peer_id == peer_id)


def test_the_only_holder_refusing_one_step_is_deprioritised_not_fatal(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    first = NodeID(next(p for p in swarm.peers if p.name == "first").peer_id)
    chain = client.aclient.chain
    real_step, steps = chain.step, itertools.count()

    async def step(
        session_id: Any, stages: Any, position: int, hidden: torch.Tensor, max_length: int, **how: Any
    ) -> Any:
        if next(steps) == 3:  # one column too many: `first` must refuse it (ProtocolError, first hand)
            hidden = torch.cat([hidden, hidden[:, :1]], dim=1)
        return await real_step(session_id, stages, position, hidden, max_length, **how)

    chain.step = step  # type: ignore[method-assign]
    try:
        tokens = answer(client, lambda session, n: None)
    finally:
        del chain.step  # type: ignore[attr-defined]
    assert tokens == expected
    session = client.aclient.last_session
    assert session is not None and session.route_waits == 0
    assert [(f.error, f.peer, f.action) for f in session.failover_log] == [
        ("ProtocolError", first, Action.BAN_AND_REROUTE)
    ]
    assert session.stages[0].peer_id == first  # banned, and still the one serving 0:2


def test_a_vanished_mid_route_peer_is_found_by_a_probe_long_before_the_step_timeout(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    vanished: list[PeerProcess] = []

    def stop_the_middle_peer(session: InferenceSession, n: int) -> None:
        if n == 4:
            vanished.append(peer_of(swarm, session.stages[1].peer_id))
            os.killpg(vanished[0].proc.pid, signal.SIGSTOP)  # its connections stay open; nothing answers

    try:
        tokens = answer(client, stop_the_middle_peer)
    finally:
        for peer in vanished:
            peer.kill()  # SIGKILL ends a stopped group too
    assert tokens == expected
    session = client.aclient.last_session
    assert session is not None
    gone = NodeID(vanished[0].peer_id)
    # the step through it would have hung for the hour-long step timeout: our probe ended it
    assert [(f.error, f.peer, f.detected_by, f.action) for f in session.failover_log] == [
        ("PeerSilent", gone, "probe", Action.WITHDRAW)
    ]
    assert gone not in {s.peer_id for s in session.stages}
    assert gone in client.aclient.routes.withdrawn  # type: ignore[attr-defined]


def test_a_sigkilled_mid_route_peer_fails_over_to_its_replica_and_is_withdrawn(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    swarm.start_peer("2:4", name="mid3", extra_args=FIXED, timeout_s=120)  # the test before took one of two
    killed: list[PeerProcess] = []

    def kill_the_middle_peer(session: InferenceSession, n: int) -> None:
        if n == 4:
            killed.append(peer_of(swarm, session.stages[1].peer_id))
            os.kill(killed[0].proc.pid, signal.SIGKILL)  # the peer's own process, as `kill -9 PID` does

    try:
        tokens = answer(client, kill_the_middle_peer)
    finally:
        for peer in killed:
            peer.kill()
    assert tokens == expected
    session = client.aclient.last_session
    assert session is not None and session.failovers == 1
    [failover] = session.failover_log
    dead = NodeID(killed[0].peer_id)
    assert failover.peer == dead and failover.action is Action.WITHDRAW
    assert failover.error != "TimeoutError"  # noticed by the broken connection (or a probe), not a deadline
    assert dead in client.aclient.routes.withdrawn  # type: ignore[attr-defined]
    assert dead not in {s.peer_id for s in session.stages}
    # only the replacement refilled its cache, from what the first hop had sent on; "last" kept its cache
    [replay] = session.replays
    assert (replay.stages, replay.resent_by) == (session.stages[1:2], session.stages[0].peer_id)
    assert session.replayed_tokens == replay.tokens > len(PROMPT_IDS)


def test_with_the_only_holder_restarting_the_answer_waits_and_completes(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    last = next(p for p in swarm.peers if p.name == "last")
    result: dict[str, Any] = {}

    def kill_last(session: InferenceSession, n: int) -> None:
        if n == 4:
            result["session"] = session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(last.proc.pid, signal.SIGKILL)

    def run() -> None:
        try:
            result["tokens"] = answer(client, kill_last)
        except (SwarmError, TimeoutError) as error:  # re-raised in the test's thread below
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    # the restart begins only once the client is seen waiting for a route: nothing serves 4:6 meanwhile
    while "error" not in result and not (result.get("session") and result["session"].route_waits):
        assert time.monotonic() < deadline, "the client never waited for a route"
        time.sleep(0.05)
    last.proc.wait(timeout=10)
    swarm.start_peer("4:6", name="last_again", extra_args=FIXED, timeout_s=120)
    thread.join(timeout=150)
    assert "error" not in result, result.get("error")
    assert result["tokens"] == expected
    session = result["session"]
    log = session.failover_log
    assert session.route_waits >= 1, log
    # the first failover is the dead holder's (later ones, if any, would be a busy machine's slow answers)
    assert log[0].peer == NodeID(last.peer_id) and log[0].action is Action.WITHDRAW, log
    assert session.stages[-1].peer_id == NodeID(swarm.peers[-1].peer_id), log
