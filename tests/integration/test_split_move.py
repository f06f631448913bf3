"""Prefill on one route, decode on another, with real peers: after the prompt each prefill peer hands the
session's KV cache to its decode peer (rpc_move), and decoding goes on there with nothing replayed.

Five ``swarm-peer`` processes of the tiny model (6 layers), nobody following the plan: the prefill route
p1 0:3 -> p2 3:6, the decode peers d1 0:3 and d2 3:6, ``small`` 0:3 whose cache is too small for the
session (it refuses the hand-over), and ``whole`` 0:6, whose one stage moves to d1 and d2 in two parts. Greedy tokens equal local transformers' in every case.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from client import SwarmClient
from client.chain import RemoteChain
from client.generation import GenerationRequest, generate_ids
from client.session import InferenceSession
from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Route, Stage
from swarm.testing import LocalSwarm, greedy_reference
from swarm.testing.launcher import PeerProcess
from swarm.transport import call_info, call_move
from swarm.types import LayerRange, NodeID
from swarm.wire import MoveRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 10
FIXED = ["--no-follow-plan", "--no-plan"]
MAX_LENGTH_TOKENS = 64  # each session's reservation
SMALL_CACHE_TOKENS = (
    32  # enough to measure its speed, under a session's reservation: it refuses the hand-over
)
SETTINGS: dict[str, Any] = dict(step_timeout_s=60.0, route_wait_s=30.0, spot_check_rate=0.0, speculate="off")


@pytest.fixture(scope="module")
def expected(tiny_source: ModelSource) -> list[int]:
    return greedy_reference(tiny_source, PROMPT_IDS, NEW_TOKENS)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tmp_path_factory.mktemp("split"), model="tiny:0") as local:
        local.start_peer("0:3", name="p1", extra_args=FIXED)
        for name, layers in (("p2", "3:6"), ("d1", "0:3"), ("d2", "3:6"), ("whole", "0:6")):
            local.start_peer(layers, name=name, extra_args=FIXED, wait=False)
        small = [*FIXED, "--cache-tokens", str(SMALL_CACHE_TOKENS)]
        local.start_peer("0:3", name="small", extra_args=small, wait=False)
        local.wait_all_ready(timeout_s=120)
        yield local


@pytest.fixture(scope="module")
def client(swarm: LocalSwarm) -> Iterator[SwarmClient]:
    with SwarmClient(swarm.initial_peers, model="tiny:0", **SETTINGS) as c:
        c.run(_until_all_known(c, swarm))
        yield c


async def _until_all_known(client: SwarmClient, swarm: LocalSwarm) -> None:
    """Read the DHT until every peer's record is in the client's snapshot (the chain dials by it)."""
    wanted = {p.peer_id for p in swarm.peers}
    async with asyncio.timeout(60):
        while not wanted <= set((await client.aclient.routes.snapshot(force=True)).peers):
            await asyncio.sleep(0.2)  # the peers announce on their own schedule: poll the DHT


def _peer(swarm: LocalSwarm, name: str) -> PeerProcess:
    return next(p for p in swarm.peers if p.name == name)


def _route(swarm: LocalSwarm, *stages: tuple[str, int, int]) -> Route:
    return tuple(Stage(NodeID(_peer(swarm, n).peer_id), LayerRange(a, b)) for n, a, b in stages)


def _recording(chain: RemoteChain) -> list[tuple[frozenset[str], int, int]]:
    """(peers, position, tokens) of every step the client sends through ``chain`` from now on."""
    steps: list[tuple[frozenset[str], int, int]] = []
    step = chain.step

    async def recorded(
        session_id: Any, stages: Any, position: int, hidden: torch.Tensor, *a: Any, **k: Any
    ) -> Any:
        steps.append((frozenset(str(s.peer_id) for s in stages), position, int(hidden.shape[0])))
        return await step(session_id, stages, position, hidden, *a, **k)

    chain.step = recorded  # type: ignore[method-assign]
    return steps


def _generate(
    client: SwarmClient, prefill: Route, decode: Route | None
) -> tuple[list[int], InferenceSession]:
    async def run() -> tuple[list[int], InferenceSession]:
        session = client.aclient.new_session(MAX_LENGTH_TOKENS)
        session.stages, session.decode_route = prefill, decode
        request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())
        try:
            tokens = [t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)]
        finally:
            await session.close()
        return tokens, session

    return client.run(run())


def test_a_session_prefills_on_one_route_and_decodes_on_another_without_replay(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    prefill = _route(swarm, ("p1", 0, 3), ("p2", 3, 6))
    decode = _route(swarm, ("d1", 0, 3), ("d2", 3, 6))
    chain = client.aclient.chain
    assert isinstance(chain, RemoteChain)
    steps = _recording(chain)
    try:
        tokens, session = _generate(client, prefill, decode)
    finally:
        del chain.step  # the class's own again
    assert tokens == expected
    assert [(m.error, m.tokens) for m in session.moves] == [("", len(PROMPT_IDS))] * 2
    assert session.stages == decode
    assert session.replays == [] and session.replayed_tokens == 0 and session.failovers == 0
    # the decode peers served no prefill: every step through them was one token after the prompt
    decoders = {s.peer_id for s in decode}
    through = [(position, tokens) for peers, position, tokens in steps if peers & decoders]
    assert through == [(len(PROMPT_IDS) + i, 1) for i in range(NEW_TOKENS - 1)]
    for name in ("d1", "d2"):
        assert "installed session" in _peer(swarm, name).log_path.read_text(errors="replace")


def test_a_stage_holding_both_decode_stages_layers_moves_to_them_in_parts(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    prefill = _route(swarm, ("whole", 0, 6))
    decode = _route(swarm, ("d1", 0, 3), ("d2", 3, 6))
    tokens, session = _generate(client, prefill, decode)
    assert tokens == expected
    assert [(m.error, m.tokens, m.part) for m in session.moves] == [
        ("", len(PROMPT_IDS), LayerRange(0, 3)),
        ("", len(PROMPT_IDS), LayerRange(3, 6)),
    ]
    assert session.stages == decode
    assert session.replays == [] and session.replayed_tokens == 0 and session.failovers == 0
    whole, chain = _peer(swarm, "whole"), client.aclient.chain
    assert isinstance(chain, RemoteChain)
    info = client.run(call_info(chain.p2p, whole.peer_id, maddrs=tuple(whole.maddrs)))
    assert info.active_sessions == 0  # closed there once both parts were in


def test_a_refused_move_decodes_that_stage_on_the_prefill_route(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    prefill = _route(swarm, ("p1", 0, 3), ("p2", 3, 6))
    decode = _route(swarm, ("small", 0, 3), ("d2", 3, 6))
    tokens, session = _generate(client, prefill, decode)
    assert tokens == expected
    assert session.stages == (prefill[0], decode[1])
    refused, moved = session.moves
    assert refused.error.startswith("CapacityError") and "cache tokens" in refused.error
    assert moved.error == "" and session.replays == [] and session.failovers == 0


def test_hostile_moves_get_clear_errors_and_the_session_goes_on(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    """Moves the session's client never asked for, sent after the prompt: a wrong origin, an unknown session,
    a target that does not hold the session's layers, one that has it open already, the peer itself, layers the
    session does not hold here, a part sent before. Each fails alone; the session decodes on, exactly."""
    prefill = _route(swarm, ("p1", 0, 3), ("p2", 3, 6))
    chain = client.aclient.chain
    assert isinstance(chain, RemoteChain)
    p1, p2 = _peer(swarm, "p1"), _peer(swarm, "p2")
    errors: list[BaseException] = []

    async def hostile(session_id: str) -> None:
        d1, d2 = _peer(swarm, "d1"), _peer(swarm, "d2")  # d2 holds 3:6, not the session's 0:3 on p1
        for request in (
            MoveRequest(session_id, d1.peer_id, origin="QmSomebodyElse"),
            MoveRequest(secrets.token_hex(16), d1.peer_id),
            MoveRequest(session_id, d2.peer_id, tuple(d2.maddrs)),
            MoveRequest(
                session_id, p2.peer_id, tuple(p2.maddrs)
            ),  # the session's next hop: open there already
            MoveRequest(session_id, p1.peer_id),  # the peer itself
            MoveRequest(session_id, d1.peer_id, tuple(d1.maddrs), layers=(2, 5)),  # layers it does not hold
            MoveRequest(session_id, d1.peer_id, tuple(d1.maddrs), layers=(0, 2)),  # a part: it goes
            MoveRequest(session_id, d1.peer_id, tuple(d1.maddrs), layers=(1, 3)),  # layer 1 again: refused
        ):
            try:
                await call_move(chain.p2p, p1.peer_id, request, maddrs=tuple(p1.maddrs), timeout_s=30)
            except (ProtocolError, SessionError, CapacityError) as error:
                errors.append(error)

    async def run() -> list[int]:
        session = client.aclient.new_session(MAX_LENGTH_TOKENS)
        session.stages = prefill
        request = GenerationRequest(tuple(PROMPT_IDS), NEW_TOKENS, frozenset())
        tokens: list[int] = []
        try:
            async for token in generate_ids(session, request, Sampler(SamplingParams()).sample):
                tokens.append(token)
                if len(tokens) == 1:
                    await hostile(session.session_id)
        finally:
            await session.close()
        assert session.stages == prefill and session.replays == []
        return tokens

    assert client.run(run()) == expected
    kinds = [
        ProtocolError,
        SessionError,
        CapacityError,
        SessionError,
        ProtocolError,
        ProtocolError,
        ProtocolError,
    ]
    assert [type(e) for e in errors] == kinds, errors
    assert "origin" in str(errors[0]) and "no session" in str(errors[1]) and "holds 3:6" in str(errors[2])
    assert "already open" in str(errors[3]) and "the peer it is on" in str(errors[4])
    assert "cannot move layers 2:5" in str(errors[5]) and "handed over already" in str(errors[6])


def test_a_killed_target_leaves_the_session_on_the_prefill_route(
    swarm: LocalSwarm, client: SwarmClient, expected: list[int]
) -> None:
    """Last in this module: it kills a peer."""
    small = _peer(swarm, "small")
    small.kill()
    small.proc.wait(timeout=30)
    prefill = _route(swarm, ("p1", 0, 3), ("p2", 3, 6))
    tokens, session = _generate(client, prefill, (Stage(NodeID(small.peer_id), LayerRange(0, 3)),))
    assert tokens == expected
    assert session.stages == prefill and session.replays == []
    assert len(session.moves) == 1 and session.moves[0].error != "", session.moves
