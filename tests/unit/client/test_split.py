"""Sessions that prefill on one route and decode on another (client/split.py, InferenceSession.move), over
in-process peers: each stage's cache moves to its decode peer after the prompt, decoding goes on there at the
same position with nothing computed again, and greedy output stays that of transformers. A stage whose move
fails stays on its prefill peer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from client.generation import GenerationRequest, generate_ids
from client.local import LocalChain
from client.session import InferenceSession
from client.split import plan_moves
from swarm.errors import CapacityError
from swarm.models.head import Sampler, SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Route, Stage
from swarm.types import LayerRange, NodeID
from tests.unit.client.test_local_generation import PROMPT_IDS, greedy_reference, make_client

pytestmark = pytest.mark.timeout(120)
STEPS = 10
PEERS = {
    "a": (0, 2),
    "b": (2, 4),
    "c": (4, 6),
    "a2": (0, 2),
    "b2": (2, 4),
    "c2": (4, 6),
    "x": (0, 3),
    "y": (3, 6),
    "w": (0, 6),
}


def _route(*stages: tuple[str, int, int]) -> Route:
    return tuple(Stage(NodeID(p), LayerRange(a, b)) for p, a, b in stages)


PREFILL = _route(("a", 0, 2), ("b", 2, 4), ("c", 4, 6))


@pytest.fixture(scope="module")
def reference(tiny_source: ModelSource) -> Any:
    return tiny_source.load_reference_model()


def _generate(
    tiny_source: ModelSource, decode: Route, refusing: str = "", prefill: Route = PREFILL
) -> tuple[list[int], Any, Any]:
    client, chain = make_client(tiny_source, PEERS)
    if refusing:
        chain.refusing[NodeID(refusing)] = CapacityError("this peer's cache is full")

    async def run() -> tuple[list[int], InferenceSession]:
        session = client.new_session(len(PROMPT_IDS) + STEPS)
        session.stages, session.decode_route = prefill, decode
        request = GenerationRequest(tuple(PROMPT_IDS), STEPS, frozenset())
        try:
            return [
                t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)
            ], session
        finally:
            await session.close()

    tokens, session = asyncio.run(run())
    return tokens, session, chain


def _computed_by(chain: LocalChain, peers: set[str]) -> list[tuple[str, int, int]]:
    return [c for c in chain.calls if c[0] in peers]


def test_a_session_moves_every_stage_after_its_prompt_and_decodes_there_without_replay(
    tiny_source: ModelSource, reference: Any
) -> None:
    decode = _route(("a2", 0, 2), ("b2", 2, 4), ("c2", 4, 6))
    tokens, session, chain = _generate(tiny_source, decode)
    assert tokens == greedy_reference(reference, PROMPT_IDS, STEPS)
    assert chain.moves == [("a", "a2", 8), ("b", "b2", 8), ("c", "c2", 8)]
    assert session.stages == decode and session.replays == [] and session.failovers == 0
    # the decode peers computed only the decode steps, one token each from position 8 on
    assert _computed_by(chain, {"a2", "b2", "c2"}) == [
        (p, 8 + i, 1) for i in range(STEPS - 1) for p in ("a2", "b2", "c2")
    ]
    assert _computed_by(chain, {"a", "b", "c"}) == [("a", 0, 8), ("b", 0, 8), ("c", 0, 8)]


def test_a_decode_route_cut_elsewhere_moves_only_the_stages_a_decode_peer_holds_whole(
    tiny_source: ModelSource, reference: Any
) -> None:
    tokens, session, chain = _generate(tiny_source, _route(("x", 0, 3), ("y", 3, 6)))
    assert tokens == greedy_reference(reference, PROMPT_IDS, STEPS)
    # b (2:4) straddles x and y: neither holds all its layers, so it stays
    assert chain.moves == [("a", "x", 8), ("c", "y", 8)]
    assert session.stages == _route(("x", 0, 2), ("b", 2, 4), ("y", 4, 6))
    assert session.replays == []


def test_a_refused_move_leaves_that_stage_on_the_prefill_route(
    tiny_source: ModelSource, reference: Any
) -> None:
    decode = _route(("a2", 0, 2), ("b2", 2, 4), ("c2", 4, 6))
    tokens, session, chain = _generate(tiny_source, decode, refusing="b2")
    assert tokens == greedy_reference(reference, PROMPT_IDS, STEPS)
    assert chain.moves == [("a", "a2", 8), ("c", "c2", 8)]
    assert session.stages == _route(("a2", 0, 2), ("b", 2, 4), ("c2", 4, 6))
    assert [m.error.split(":")[0] for m in session.moves] == ["", "CapacityError", ""]
    assert session.replays == [] and _computed_by(chain, {"b2"}) == []


def test_planning_skips_peers_on_the_route_and_peers_taken_by_an_earlier_stage() -> None:
    holds = {((0, 3), "d"), ((3, 6), "d"), ((3, 6), "e")}
    prefill = _route(("a", 0, 3), ("b", 3, 6))
    decode = _route(("d", 0, 6), ("e", 3, 6))

    def held(layers: LayerRange, peer: str) -> bool:
        return ((layers.start, layers.end), peer) in holds

    assert plan_moves(prefill, decode, held) == [(0, _route(("d", 0, 3))), (1, _route(("e", 3, 6)))]
    # a decode peer already on the prefill route is no target (the route would name it twice)
    assert plan_moves(prefill, _route(("b", 0, 6)), lambda layers, p: True) == []


def test_planning_splits_a_stage_along_the_decode_cuts_only_when_every_part_can_go() -> None:
    prefill = _route(("w", 0, 6))
    decode = _route(("x", 0, 2), ("y", 2, 4), ("z", 4, 6))

    def held(layers: LayerRange, peer: str) -> bool:  # each decode peer holds its decode stage's layers
        return any(d.peer_id == peer and d.layers.covers(layers) for d in decode)

    assert plan_moves(prefill, decode, held) == [(0, decode)]
    # z does not hold 4:6: no part moves (a stage goes whole or in all its parts)
    assert plan_moves(prefill, decode, lambda layers, p: held(layers, p) and p != "z") == []
    # a peer already on the route takes no part
    assert plan_moves(_route(("w", 0, 4), ("z", 4, 6)), decode, held) == [
        (0, _route(("x", 0, 2), ("y", 2, 4)))
    ]


def test_a_stage_split_between_two_decode_peers_moves_in_parts_and_closes_on_its_prefill_peer(
    tiny_source: ModelSource, reference: Any
) -> None:
    decode = _route(("x", 0, 3), ("y", 3, 6))
    tokens, session, chain = _generate(tiny_source, decode, prefill=_route(("w", 0, 6)))
    assert tokens == greedy_reference(reference, PROMPT_IDS, STEPS)
    assert chain.moves == [("w", "x", 8), ("w", "y", 8)]
    assert [m.part for m in session.moves] == [LayerRange(0, 3), LayerRange(3, 6)]
    assert session.stages == decode and session.replays == [] and session.failovers == 0
    assert _computed_by(chain, {"w"}) == [("w", 0, 8)]
    assert _computed_by(chain, {"x", "y"}) == [(p, 8 + i, 1) for i in range(STEPS - 1) for p in ("x", "y")]
    assert not chain.blocks[NodeID("w")].active_sessions  # closed there once both parts were in


def test_a_refused_part_keeps_the_stage_whole_on_its_prefill_peer_and_closes_the_parts_sent(
    tiny_source: ModelSource, reference: Any
) -> None:
    decode = _route(("x", 0, 3), ("y", 3, 6))
    tokens, session, chain = _generate(tiny_source, decode, refusing="y", prefill=_route(("w", 0, 6)))
    assert tokens == greedy_reference(reference, PROMPT_IDS, STEPS)
    assert chain.moves == [("w", "x", 8)]
    assert session.stages == _route(("w", 0, 6)) and session.replays == []
    assert [m.error.split(":")[0] for m in session.moves] == ["", "CapacityError"]
    assert _computed_by(chain, {"x", "y"}) == []
    assert not chain.blocks[NodeID("x")].active_sessions  # the part it took is closed again


def test_without_a_route_given_the_session_moves_to_the_route_of_the_plans_decode_flows(
    tiny_source: ModelSource, reference: Any
) -> None:
    client, chain = make_client(tiny_source, PEERS)
    decode = _route(("a2", 0, 2), ("b2", 2, 4), ("c2", 4, 6))
    asked: list[int] = []

    async def decode_route(session_tokens: int, avoid: frozenset[NodeID] = frozenset()) -> Route | None:
        asked.append(session_tokens)
        return decode

    client.routes.decode_route = decode_route  # type: ignore[method-assign]  # as SwarmRoutes from decode flows

    async def run() -> list[int]:
        session = client.new_session(len(PROMPT_IDS) + STEPS)
        session.stages = PREFILL
        request = GenerationRequest(tuple(PROMPT_IDS), STEPS, frozenset())
        try:
            return [t async for t in generate_ids(session, request, Sampler(SamplingParams()).sample)]
        finally:
            await session.close()

    assert asyncio.run(run()) == greedy_reference(reference, PROMPT_IDS, STEPS)
    assert asked == [len(PROMPT_IDS) + STEPS]  # asked once, after the prompt
    assert chain.moves == [("a", "a2", 8), ("b", "b2", 8), ("c", "c2", 8)]
