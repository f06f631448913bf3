"""A failover replays only the stages it replaced (client/session.py `_replay`), over in-process peers: the
kept stage before them resends what it logged, the client sends embeddings where there is none, and stages
that still hold the session never compute it again. Greedy output stays that of transformers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from client.local import LocalChain
from client.session import InferenceSession, join_route
from swarm.models.faults import OutputFaults
from swarm.models.head import SamplingParams
from swarm.models.loading import ModelSource
from swarm.routing.route import Stage
from swarm.types import LayerRange, NodeID
from tests.unit.client.test_local_generation import PROMPT_IDS, TINY_SPLIT, greedy_reference, make_client

pytestmark = pytest.mark.timeout(120)
STEPS = 12


@pytest.fixture(scope="module")
def reference(tiny_source: ModelSource) -> Any:
    return tiny_source.load_reference_model()


def _recomputed(chain: LocalChain, peers: set[str]) -> list[tuple[str, int, int]]:
    """Steps at position 0 that ``peers`` ran: the prompt, or a replay."""
    return [c for c in chain.calls if c[0] in peers and c[1] == 0]


def _kill_at(client: Any, chain: LocalChain, step: int, index: int, also: Any = None) -> dict[str, NodeID]:
    killed: dict[str, NodeID] = {}

    def hook(count: int) -> None:
        if count == step:
            session = client.last_session
            killed["peer"] = session.stages[index].peer_id
            chain.dead.add(killed["peer"])
            if also is not None:
                also(session)

    chain.on_step = hook
    return killed


def _session(client: Any) -> InferenceSession:
    session = client.last_session
    assert isinstance(session, InferenceSession)
    return session


def test_a_failed_first_stage_is_refilled_by_the_client_alone(
    tiny_source: ModelSource, reference: Any
) -> None:
    client, chain = make_client(tiny_source, {**TINY_SPLIT, "a2": (0, 2)})
    killed = _kill_at(client, chain, 5, 0)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, STEPS, SamplingParams()))
    assert got == greedy_reference(reference, PROMPT_IDS, STEPS)
    session, survivor = _session(client), "a2" if killed["peer"] == "a" else "a"
    # the step at position 11 failed on the first stage: the client sent the embeddings of the 11 tokens
    # through the new first stage only; "b" and "c" kept their caches and took the step from it
    assert [(r.stages, r.tokens, r.resent_by) for r in session.replays] == [
        ((Stage(NodeID(survivor), LayerRange(0, 2)),), 11, None)
    ]
    assert _recomputed(chain, {"b", "c"}) == [("b", 0, 8), ("c", 0, 8)] and chain.resends == []
    assert session.replayed_tokens == 11


def test_a_kept_stage_without_a_log_falls_back_to_a_replay_from_the_client(
    tiny_source: ModelSource, reference: Any
) -> None:
    """As after a restart of the hop before the failed one: it holds no log, so the client replays from stage
    0 up to the replaced stage; the stage after it still keeps its cache."""
    client, chain = make_client(tiny_source, {**TINY_SPLIT, "b2": (2, 4)})

    def forget_log(session: InferenceSession) -> None:
        chain.sent.pop((NodeID("a"), session.session_id))

    killed = _kill_at(client, chain, 5, 1, also=forget_log)
    got = asyncio.run(client.generate_ids(PROMPT_IDS, STEPS, SamplingParams()))
    assert got == greedy_reference(reference, PROMPT_IDS, STEPS)
    session, survivor = _session(client), "b2" if killed["peer"] == "b" else "b"
    stages = (Stage(NodeID("a"), LayerRange(0, 2)), Stage(NodeID(survivor), LayerRange(2, 4)))
    assert [(r.stages, r.tokens, r.resent_by) for r in session.replays] == [(stages, 11, None)]
    assert _recomputed(chain, {"c"}) == [("c", 0, 8)]
    assert session.replayed_tokens == 22


def test_a_replacement_that_dies_during_its_refill_is_replaced_in_turn(
    tiny_source: ModelSource, reference: Any
) -> None:
    client, chain = make_client(tiny_source, {**TINY_SPLIT, "b2": (2, 4), "b3": (2, 4)})
    dead: list[NodeID] = []

    def hook(count: int) -> None:
        session = client.last_session
        if count in (5, 6):  # the step at 11 through "b"; then the resend's step through its replacement
            dead.append(session.stages[1].peer_id)
            chain.dead.add(dead[-1])

    chain.on_step = hook
    got = asyncio.run(client.generate_ids(PROMPT_IDS, STEPS, SamplingParams()))
    assert got == greedy_reference(reference, PROMPT_IDS, STEPS)
    session = _session(client)
    (last,) = {"b", "b2", "b3"} - set(dead)
    assert session.failovers == 2 and chain.resends[-1] == ("a", 0, 11)
    assert [(r.stages, r.resent_by) for r in session.replays] == [
        ((Stage(NodeID(last), LayerRange(2, 4)),), "a")
    ]
    # neither "a" nor "c" computed the prefix again, through two failovers
    assert _recomputed(chain, {"a", "c"}) == [("a", 0, 8), ("c", 0, 8)]


def test_two_failovers_in_one_session_each_refill_only_their_stage(
    tiny_source: ModelSource, reference: Any
) -> None:
    ranges = {"a": (0, 2), "b": (2, 3), "c": (3, 4), "d": (4, 6), "b2": (2, 3), "d2": (4, 6)}
    client, chain = make_client(tiny_source, ranges)
    killed: list[NodeID] = []

    def hook(count: int) -> None:
        session = client.last_session
        for at, index in ((4, 1), (9, 3)):
            if count == at:
                killed.append(session.stages[index].peer_id)
                chain.dead.add(killed[-1])

    chain.on_step = hook
    got = asyncio.run(client.generate_ids(PROMPT_IDS, STEPS, SamplingParams()))
    assert got == greedy_reference(reference, PROMPT_IDS, STEPS)
    session = _session(client)
    assert session.failovers == 2
    assert [(r.tokens, r.resent_by) for r in session.replays] == [(10, "a"), (13, "c")]
    assert _recomputed(chain, {"a", "c"}) == [("a", 0, 8), ("c", 0, 8)]
    assert session.replayed_tokens == 10 + 13


def test_a_liar_caught_mid_session_gets_every_stage_after_it_refilled(
    tiny_source: ModelSource, reference: Any
) -> None:
    """The stages after a liar computed from its outputs, so the failover refills them too (not only its
    replacement); the stage before it resends, and keeps its cache."""
    client, chain = make_client(
        tiny_source, {**TINY_SPLIT, "b2": (2, 4)}, spot_check_tokens=4, spot_check_blocking=True
    )
    liar: list[NodeID] = []

    def start_lying(count: int) -> None:
        if count == 5:  # the step at position 11: the liar corrupts it, and every step is checked from now on
            liar.append(client.last_session.stages[1].peer_id)
            chain.faulty[liar[0]] = OutputFaults(1.0, seed=1)
            client.checker.rate = 1.0

    chain.on_step = start_lying
    got = asyncio.run(client.generate_ids(PROMPT_IDS, STEPS, SamplingParams()))
    assert got == greedy_reference(reference, PROMPT_IDS, STEPS)
    session = _session(client)
    assert client.checker.excluded == {liar[0]}
    honest = "b2" if liar[0] == "b" else "b"
    refilled = (Stage(NodeID(honest), LayerRange(2, 4)), Stage(NodeID("c"), LayerRange(4, 6)))
    assert [(r.stages, r.tokens, r.resent_by) for r in session.replays] == [(refilled, 11, "a")]
    assert session.replayed_tokens == 22


def _stage(peer: str, start: int, end: int) -> Stage:
    return Stage(NodeID(peer), LayerRange(start, end))


def test_a_tail_that_starts_on_the_last_kept_peer_becomes_one_stage_and_a_repeat_is_no_route() -> None:
    """Seen on real peers: kept a(0:2), the tail from layer 2 began on a again (it holds 0:4), and a refused the
    route a, a, ... as naming it twice, then got banned for it."""
    kept = (_stage("a", 0, 2),)
    assert join_route(kept, (_stage("a", 2, 4), _stage("c", 4, 6))) == (_stage("a", 0, 4), _stage("c", 4, 6))
    assert join_route(kept, (_stage("b", 2, 4), _stage("c", 4, 6))) == (
        *kept,
        _stage("b", 2, 4),
        _stage("c", 4, 6),
    )
    assert join_route((_stage("a", 0, 1), _stage("b", 1, 2)), (_stage("a", 2, 6),)) is None
    assert join_route((), (_stage("a", 0, 6),)) == (_stage("a", 0, 6),)


def test_a_session_evicted_mid_answer_is_replayed_exactly_on_its_stage(
    tiny_source: ModelSource, reference: Any
) -> None:
    """The middle peer's cache was short and took our idle session's blocks back: its next step is told
    SessionEvicted, and the client refills that stage alone (the first stage resends its log) and goes on; the
    greedy tokens stay transformers'."""
    client, chain = make_client(tiny_source, TINY_SPLIT)

    def evict(count: int) -> None:
        if count == 5:
            chain.blocks[NodeID("b")].cache.evict(_session(client).session_id)

    chain.on_step = evict
    got = asyncio.run(client.generate_ids(PROMPT_IDS, STEPS, SamplingParams()))
    assert got == greedy_reference(reference, PROMPT_IDS, STEPS)
    session = _session(client)
    assert [(f.error, f.peer, f.action.name) for f in session.failover_log] == [
        ("SessionEvicted", "b", "REPLAY")
    ]
    assert [(r.stages, r.tokens, r.resent_by) for r in session.replays] == [
        ((Stage(NodeID("b"), LayerRange(2, 4)),), 11, "a")
    ]
    assert _recomputed(chain, {"a", "c"}) == [("a", 0, 8), ("c", 0, 8)]
