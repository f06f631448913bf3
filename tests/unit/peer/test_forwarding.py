"""The Forwarder: one-token wait_result steps on the same remaining route in one loop turn go as one message, each
with its own outcome; relayed steps and prefills go alone. The senders are recording fakes."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from swarm.errors import CapacityError, ProtocolError, SwarmError, TransportError
from swarm.peer.forwarding import Answer, Forwarder
from swarm.wire import Hop, HopTiming, StepAck, StepReply, StepRequest

pytestmark = pytest.mark.timeout(30)

NEXT, OTHER = Hop("QmNext", (), 2, 4), Hop("QmOther", (), 2, 4)


def _step(
    session_id: str, tokens: int = 1, wait_result: bool = True, rest: tuple[Hop, ...] = ()
) -> StepRequest:
    return StepRequest(session_id, 0, torch.zeros(tokens, 8), 2, 4, 64, "hash", rest, wait_result=wait_result)


def _answer(request: StepRequest, hop: Hop) -> Answer:
    """What ``hop`` answers ``request``: an ack naming it, or (relayed) an output made from the step's own."""
    timings = (HopTiming(hop.peer_id, 2, 4, 0.0, 0.0, float(len(request.session_id))),)
    if request.wait_result:
        return StepAck(timings)
    return StepReply(request.hidden + len(request.session_id), timings)


class Senders:
    """Records what went out: ("one", peer, [session]) or ("many", peer, [sessions]); fails as told."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[str]]] = []
        self.fail_many: BaseException | None = None
        self.refuse: set[str] = set()  # sessions whose step the next hop answers with an error

    async def one(self, hop: Hop, request: StepRequest, timeout_s: float) -> Answer:
        self.sent.append(("one", hop.peer_id, [request.session_id]))
        await asyncio.sleep(0)
        if request.session_id in self.refuse:
            raise CapacityError(f"no room for {request.session_id}")
        return _answer(request, hop)

    async def many(
        self, hop: Hop, requests: list[StepRequest], timeout_s: float
    ) -> list[Answer | SwarmError]:
        self.sent.append(("many", hop.peer_id, [r.session_id for r in requests]))
        await asyncio.sleep(0)
        if self.fail_many is not None:
            raise self.fail_many
        return [
            CapacityError(f"no room for {r.session_id}") if r.session_id in self.refuse else _answer(r, hop)
            for r in requests
        ]


def _forward_all(forwarder: Forwarder, items: list[tuple[Hop, StepRequest]]) -> list[Answer | BaseException]:
    async def main() -> list[Answer | BaseException]:
        # every forward starts in the same loop turn, as the handlers of one executor batch resume together
        forwards = (forwarder.forward(hop, request, 5.0) for hop, request in items)
        return await asyncio.gather(*forwards, return_exceptions=True)

    return asyncio.run(main())


def test_steps_for_one_hop_in_one_turn_go_as_one_message_each_with_its_own_answer() -> None:
    senders = Senders()
    forwarder = Forwarder(senders.one, senders.many)
    items = [(NEXT, _step(f"s{i}")) for i in range(6)] + [(OTHER, _step("o1")), (OTHER, _step("o22"))]
    random.Random(3).shuffle(items)
    results = _forward_all(forwarder, items)
    for (hop, request), result in zip(items, results, strict=True):
        expected = _answer(request, hop)
        assert isinstance(result, type(expected)) and result.timings == expected.timings, "each gets its own"
        if isinstance(result, StepReply) and isinstance(expected, StepReply):
            assert torch.equal(result.hidden, expected.hidden)
    assert sorted((kind, peer, sorted(ids)) for kind, peer, ids in senders.sent) == [
        ("many", "QmNext", [f"s{i}" for i in range(6)]),
        ("many", "QmOther", ["o1", "o22"]),
    ]
    assert (forwarder.messages, forwarder.steps) == (2, 8)


def test_relayed_steps_prefills_and_a_lone_step_go_alone() -> None:
    senders = Senders()
    forwarder = Forwarder(senders.one, senders.many)
    items = [
        (NEXT, _step("prefill", tokens=5)),
        (NEXT, _step("relayed", wait_result=False)),  # answered once its route has computed it
        (NEXT, _step("relayed2", wait_result=False)),
        (OTHER, _step("lone")),
    ]
    random.Random(5).shuffle(items)
    results = _forward_all(forwarder, items)
    assert [type(r) for r in results] == [
        StepReply if "relayed" in r.session_id else StepAck for _, r in items
    ]
    assert sorted(senders.sent) == [
        ("one", "QmNext", ["prefill"]),
        ("one", "QmNext", ["relayed"]),
        ("one", "QmNext", ["relayed2"]),
        ("one", "QmOther", ["lone"]),
    ]


def test_steps_with_hops_after_the_next_go_together_only_on_the_same_whole_route() -> None:
    """A step is acknowledged once the hops after the next one have it: steps that share a message share every
    hop that could hold its reply back, so only steps on the same remaining route go together."""
    senders = Senders()
    forwarder = Forwarder(senders.one, senders.many)
    third = Hop("QmThird", (), 4, 6)
    items = [
        *((NEXT, _step(f"via{i}", rest=(OTHER,))) for i in range(3)),
        *((NEXT, _step(f"long{i}", rest=(OTHER, third))) for i in range(2)),
        (NEXT, _step("last")),  # the next hop is its last
        (NEXT, _step("other", rest=(third,))),
    ]
    random.Random(7).shuffle(items)
    results = _forward_all(forwarder, items)
    assert all(isinstance(r, StepAck) for r in results)
    assert sorted((kind, peer, sorted(ids)) for kind, peer, ids in senders.sent) == [
        ("many", "QmNext", ["long0", "long1"]),
        ("many", "QmNext", ["via0", "via1", "via2"]),
        ("one", "QmNext", ["last"]),
        ("one", "QmNext", ["other"]),
    ]


def test_steps_naming_other_addresses_for_the_same_peer_go_apart() -> None:
    senders = Senders()
    forwarder = Forwarder(senders.one, senders.many)
    elsewhere = Hop("QmNext", ("/ip4/127.0.0.1/tcp/9/p2p/QmNext",), 2, 4)
    items = [(NEXT, _step("a")), (NEXT, _step("b")), (elsewhere, _step("c")), (elsewhere, _step("d"))]
    _forward_all(forwarder, items)
    assert sorted(ids for _, _, ids in senders.sent) == [["a", "b"], ["c", "d"]]


def test_an_error_for_one_step_fails_that_step_only() -> None:
    senders = Senders()
    senders.refuse = {"s1"}
    forwarder = Forwarder(senders.one, senders.many)
    results = _forward_all(forwarder, [(NEXT, _step(f"s{i}")) for i in range(3)])
    assert isinstance(results[1], CapacityError) and "s1" in str(results[1])
    assert isinstance(results[0], StepAck) and isinstance(results[2], StepAck)


def test_a_failed_message_fails_every_step_in_it() -> None:
    senders = Senders()
    senders.fail_many = TransportError("peer QmNext is unreachable")
    forwarder = Forwarder(senders.one, senders.many)
    results = _forward_all(forwarder, [(NEXT, _step(f"s{i}")) for i in range(3)])
    assert all(isinstance(r, TransportError) for r in results)
    assert [kind for kind, _, _ in senders.sent] == ["many"], (
        "no step is sent twice after a transport failure"
    )


def test_a_hop_that_does_not_know_batches_gets_the_steps_one_by_one() -> None:
    senders = Senders()
    senders.fail_many = ProtocolError("unexpected message kind 'steps'")
    senders.refuse = {"s2"}
    forwarder = Forwarder(senders.one, senders.many)
    results = _forward_all(forwarder, [(NEXT, _step(f"s{i}")) for i in range(3)])
    assert [type(r) for r in results] == [StepAck, StepAck, CapacityError]
    assert sorted(ids[0] for kind, _, ids in senders.sent if kind == "one") == ["s0", "s1", "s2"]


def test_a_message_that_failed_otherwise_is_not_sent_again_step_by_step() -> None:
    senders = Senders()
    senders.fail_many = ProtocolError("peer QmNext answered 2 outcomes for 3 steps")  # it may have run them
    forwarder = Forwarder(senders.one, senders.many)
    results = _forward_all(forwarder, [(NEXT, _step(f"s{i}")) for i in range(3)])
    assert all(isinstance(r, ProtocolError) for r in results)
    assert [kind for kind, _, _ in senders.sent] == ["many"]


def test_a_step_whose_caller_gave_up_is_not_sent() -> None:
    senders = Senders()
    forwarder = Forwarder(senders.one, senders.many)

    async def main() -> list[Answer | BaseException]:
        tasks = [asyncio.create_task(forwarder.forward(NEXT, _step(f"s{i}"), 5.0)) for i in range(3)]
        await asyncio.sleep(0)  # all three are held for this turn's message
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[1], StepAck) and isinstance(results[2], StepAck)
    assert senders.sent == [("many", "QmNext", ["s1", "s2"])]
