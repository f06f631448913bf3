"""Groups: a client round's steps to one first hop (its waits at one last hop) go as one message; each keeps its
own outcome."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from client.grouping import Groups, groupable
from swarm.errors import CapacityError, ProtocolError, SwarmError, TransportError
from swarm.wire import MAX_FORWARDED_STEPS, UNKNOWN_KIND, Hop, StepAck, StepReply, StepRequest

FIRST, OTHER = Hop("peer-a", (), 0, 2), Hop("peer-b", (), 0, 2)


def step(session: str, batch: tuple[str, int], *, wait_result: bool = True) -> StepRequest:
    return StepRequest(
        session, 5, torch.zeros(1, 4), 0, 2, 16, "hash", wait_result=wait_result, batch_id=batch[0],
        batch_size=batch[1],
    )  # fmt: skip


Outcome = StepAck | StepReply


class Sent:
    """A stand-in for the hop's rpc_steps: records each message (and each step sent alone), answers per step."""

    def __init__(self, answer: dict[str, Outcome | SwarmError] | None = None) -> None:
        self.messages: list[tuple[str, list[str]]] = []
        self.alone: list[str] = []
        self.answer = answer or {}
        self.fail: Exception | None = None
        self.release = asyncio.Event()
        self.release.set()

    async def many(self, hop: Hop, requests: list[StepRequest]) -> list[Outcome | SwarmError]:
        self.messages.append((hop.peer_id, [r.session_id for r in requests]))
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return [self.answer.get(r.session_id, StepAck()) for r in requests]

    async def one(self, hop: Hop, request: StepRequest) -> Outcome:
        self.alone.append(request.session_id)
        outcome = self.answer.get(request.session_id, StepAck())
        if isinstance(outcome, SwarmError):
            raise outcome
        return outcome

    def groups(self, wait_s: float) -> Groups[StepRequest, Outcome]:
        return Groups(self.many, self.one, wait_s)


def send(groups: Groups[StepRequest, Outcome], hop: Hop, request: StepRequest) -> asyncio.Future[Outcome]:
    return asyncio.ensure_future(groups.send(hop, (request.batch_id, request.batch_size), request))


def test_a_rounds_steps_to_one_hop_go_as_one_message_once_all_are_in() -> None:
    async def main() -> None:
        sent = Sent()
        groups = sent.groups(wait_s=60.0)  # never flushed by the timer here
        sessions = [f"s{i}" for i in range(4)]
        random.Random(3).shuffle(sessions)
        outcomes = await asyncio.gather(*(send(groups, FIRST, step(s, ("round", 4))) for s in sessions))
        assert sent.messages == [("peer-a", sessions)]
        assert all(isinstance(o, StepAck) for o in outcomes)

    asyncio.run(asyncio.wait_for(main(), 10))  # a group that never goes fails, not hangs


def test_groups_are_per_round_and_per_first_hop() -> None:
    async def main() -> None:
        sent = Sent()
        groups = sent.groups(wait_s=60.0)
        await asyncio.gather(
            send(groups, FIRST, step("a1", ("r1", 2))),
            send(groups, OTHER, step("b1", ("r1", 2))),
            send(groups, FIRST, step("a2", ("r2", 2))),
            send(groups, FIRST, step("a3", ("r1", 2))),
            send(groups, OTHER, step("b2", ("r1", 2))),
            send(groups, FIRST, step("a4", ("r2", 2))),
        )
        assert sorted(sent.messages) == [
            ("peer-a", ["a1", "a3"]),
            ("peer-a", ["a2", "a4"]),
            ("peer-b", ["b1", "b2"]),
        ]

    asyncio.run(asyncio.wait_for(main(), 10))  # a group that never goes fails, not hangs


def test_a_member_that_never_sends_holds_its_mates_only_the_wait() -> None:
    async def main() -> None:
        sent = Sent()
        groups = sent.groups(wait_s=0.01)
        outcomes = await asyncio.gather(*(send(groups, FIRST, step(s, ("round", 3))) for s in ("x", "y")))
        assert sent.messages == [("peer-a", ["x", "y"])]  # the third never came
        assert len(outcomes) == 2

    asyncio.run(asyncio.wait_for(main(), 10))  # a group that never goes fails, not hangs


def test_each_step_gets_its_own_outcome_and_error() -> None:
    async def main() -> None:
        full = CapacityError("peer-a is full")
        output = StepReply(torch.ones(1, 4), ())
        sent = Sent({"bad": full, "one-hop": output})
        groups = sent.groups(wait_s=60.0)
        results = await asyncio.gather(
            send(groups, FIRST, step("good", ("round", 3))),
            send(groups, FIRST, step("bad", ("round", 3))),
            send(groups, FIRST, step("one-hop", ("round", 3), wait_result=False)),
            return_exceptions=True,
        )
        assert isinstance(results[0], StepAck)
        assert results[1] is full
        assert results[2] is output

    asyncio.run(asyncio.wait_for(main(), 10))  # a group that never goes fails, not hangs


@pytest.mark.parametrize("fails", [False, True])
def test_a_cancelled_member_is_skipped_and_a_failed_message_fails_every_other_step(fails: bool) -> None:
    async def main() -> None:
        sent = Sent()
        sent.release.clear()
        sent.fail = TransportError("connection reset") if fails else None
        groups = sent.groups(wait_s=60.0)
        waiting = [send(groups, FIRST, step(s, ("round", 3))) for s in ("a", "b", "c")]
        while not sent.messages:
            await asyncio.sleep(0)
        waiting[1].cancel()  # its output came first: the session stopped waiting for the acknowledgement
        sent.release.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        expected = TransportError if fails else StepAck
        assert isinstance(results[0], expected) and isinstance(results[2], expected)
        assert isinstance(results[1], asyncio.CancelledError)

    asyncio.run(asyncio.wait_for(main(), 10))  # a group that never goes fails, not hangs


@pytest.mark.parametrize(
    ("batch", "resend", "takes"),
    [(("r", 2), 0, True), (("r", 1), 0, False), (("", 2), 0, False), (("r", 2), 3, False)],
)
def test_only_a_rounds_several_steps_are_grouped(batch: tuple[str, int], resend: int, takes: bool) -> None:
    request = StepRequest(
        "s", 5, torch.zeros(0 if resend else 1, 4), 0, 2, 16, "hash", wait_result=True, resend_tokens=resend,
        batch_id=batch[0], batch_size=batch[1],
    )  # fmt: skip
    assert groupable(request) is takes


def test_a_hop_that_does_not_know_the_message_gets_each_alone() -> None:
    async def main() -> None:
        full = CapacityError("peer-a is full")
        sent = Sent({"b": full})
        sent.fail = ProtocolError(f"{UNKNOWN_KIND} 'steps'")
        groups = sent.groups(wait_s=60.0)
        results = await asyncio.gather(
            *(send(groups, FIRST, step(s, ("round", 3))) for s in ("a", "b", "c")), return_exceptions=True
        )
        assert sent.messages == [("peer-a", ["a", "b", "c"])] and sorted(sent.alone) == ["a", "b", "c"]
        assert isinstance(results[0], StepAck) and results[1] is full and isinstance(results[2], StepAck)
        # remembered: the next round's steps go alone at once, with no message refused first
        await asyncio.gather(*(send(groups, FIRST, step(s, ("next", 2))) for s in ("d", "e")))
        assert len(sent.messages) == 1 and sorted(sent.alone) == ["a", "b", "c", "d", "e"]

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_round_bigger_than_a_message_goes_in_several() -> None:
    async def main() -> None:
        sent = Sent()
        groups = sent.groups(wait_s=0.01)  # the rest go at the wait: a message holds no more
        size = MAX_FORWARDED_STEPS + 3
        results = await asyncio.gather(
            *(send(groups, FIRST, step(f"s{i}", ("round", size))) for i in range(size))
        )
        assert [len(names) for _, names in sent.messages] == [MAX_FORWARDED_STEPS, 3]
        assert len(results) == size

    asyncio.run(asyncio.wait_for(main(), 10))


def test_members_that_stopped_waiting_before_the_group_went_are_not_sent() -> None:
    async def main() -> None:
        sent = Sent()
        groups = sent.groups(wait_s=0.01)
        gone = send(groups, FIRST, step("gone", ("round", 3)))
        kept = send(groups, FIRST, step("kept", ("round", 3)))
        await asyncio.sleep(0)
        gone.cancel()  # its step failed: it stopped waiting before the round's third member came
        assert isinstance(await kept, StepAck)
        assert sent.messages == [("peer-a", ["kept"])]
        early = send(groups, FIRST, step("early", ("other", 2)))
        await asyncio.sleep(0)
        early.cancel()
        await asyncio.gather(early, return_exceptions=True)
        assert isinstance(await send(groups, FIRST, step("mate", ("other", 2))), StepAck)  # the group is full
        assert sent.messages == [("peer-a", ["kept"]), ("peer-a", ["mate"])]

    asyncio.run(asyncio.wait_for(main(), 10))
