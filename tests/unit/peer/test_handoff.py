"""The last hop's handoff between a wait_result step and the client's wait: either may come first, a slot
nobody came for expires, and parked steps are bounded."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
import torch

from swarm.errors import CapacityError
from swarm.models.blocks import Step
from swarm.peer.handoff import Handoff, Parked
from swarm.peer.state import Served

pytestmark = pytest.mark.timeout(30)


def _parked(tokens: int = 1, tag: float = 0.0) -> Parked:
    step = Step("owner:s1", torch.full((tokens, 4), tag), 0, 2, 0)
    return Parked(cast(Served, None), step, deadline=1e9, received=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_that_comes_first_gets_the_step_when_it_arrives() -> None:
    async def body() -> None:
        handoff = Handoff()
        waiter = asyncio.create_task(handoff.take("s1", 3))
        await asyncio.sleep(0)
        assert not waiter.done()
        parked = _parked()
        handoff.park("s1", 3, parked)
        assert await waiter is parked
        assert len(handoff) == 0

    asyncio.run(body())


def test_a_step_that_comes_first_is_parked_and_a_resent_one_replaces_it() -> None:
    async def body() -> None:
        handoff = Handoff()
        handoff.park("s1", 3, _parked(tag=1.0))
        handoff.park("s1", 3, _parked(tag=2.0))  # the step sent again (a retry) before its wait came
        got = await handoff.take("s1", 3)
        assert float(got.step.hidden[0, 0]) == 2.0
        assert len(handoff) == 0

    asyncio.run(body())


def test_steps_of_other_positions_or_sessions_do_not_meet_the_wait() -> None:
    async def body() -> None:
        handoff = Handoff()
        waiter = asyncio.create_task(handoff.take("s1", 3))
        handoff.park("s1", 4, _parked())
        handoff.park("s2", 3, _parked())
        await asyncio.sleep(0)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert len(handoff) == 2  # the cancelled wait's slot is gone; the two parked steps stay

    asyncio.run(body())


def test_a_new_wait_of_a_session_replaces_its_abandoned_one() -> None:
    """A client that gave up on a step (its wait's stream closed) and replays it waits again: the new wait
    gets the step, the old one fails instead of holding the slot until its deadline."""

    async def body() -> None:
        handoff = Handoff()
        abandoned = asyncio.create_task(handoff.take("s1", 0))
        other_session = asyncio.create_task(handoff.take("s2", 0))
        await asyncio.sleep(0)
        replay = asyncio.create_task(handoff.take("s1", 0))
        await asyncio.sleep(0)
        with pytest.raises(CapacityError, match="newer wait"):
            await abandoned
        parked = _parked()
        handoff.park("s1", 0, parked)
        assert await replay is parked
        assert not other_session.done()
        other_session.cancel()

    asyncio.run(body())


def test_waits_for_other_positions_of_a_session_stand_together() -> None:
    """A client pipelining a long prompt waits for every chunk at once, in any order of arrival."""

    async def body() -> None:
        handoff = Handoff()
        later = asyncio.create_task(handoff.take("s1", 64))
        await asyncio.sleep(0)
        earlier = asyncio.create_task(handoff.take("s1", 0))
        await asyncio.sleep(0)
        first, second = _parked(tag=1.0), _parked(tag=2.0)
        handoff.park("s1", 0, first)
        handoff.park("s1", 64, second)
        assert await earlier is first and await later is second

    asyncio.run(body())


def test_a_wait_for_a_step_already_being_computed_is_refused() -> None:
    async def body() -> None:
        handoff = Handoff()
        first = asyncio.create_task(handoff.take("s1", 3))
        await asyncio.sleep(0)
        handoff.park("s1", 3, _parked())
        with pytest.raises(CapacityError, match="already waited for"):
            await handoff.take("s1", 3)
        await first

    asyncio.run(body())


def test_parked_steps_nobody_waits_for_expire_and_are_bounded() -> None:
    async def body() -> None:
        clock = Clock()
        handoff = Handoff(max_slots=2, max_parked_bytes=10 * 4 * 4, ttl_s=30.0, clock=clock)
        handoff.park("s1", 0, _parked())
        handoff.park("s2", 0, _parked())
        with pytest.raises(CapacityError, match="already wait"):
            handoff.park("s3", 0, _parked())
        clock.now = 31.0  # the first two expire: nobody came for them
        handoff.park("s3", 0, _parked(tokens=8))
        with pytest.raises(CapacityError, match="too many step outputs"):
            handoff.park("s4", 0, _parked(tokens=4))  # 8 + 4 tokens of 4 floats: over 10 tokens' bytes
        assert len(handoff) == 1

    asyncio.run(body())
