"""The announcer keeps announcing through hung and failing stores, and withdraws on exit."""

from __future__ import annotations

import asyncio

import pytest

from swarm.dht.directory import Announcer, DirectoryConfig
from swarm.dht.schemas import PeerRecord
from tests.unit.dht.records import peer_record

pytestmark = pytest.mark.timeout(10)


class ScriptedDirectory:
    """Stands in for Directory: each announce() plays the next scripted outcome, then succeeds."""

    def __init__(self, outcomes: list[str]) -> None:
        # Short deadlines and periods so the test runs in well under a second (none of it is asserted).
        self.config = DirectoryConfig(ttl_s=0.06, write_timeout_s=0.05)
        self.outcomes = outcomes
        self.calls: list[str] = []
        self.withdrawn = asyncio.Event()

    async def announce(self, record: PeerRecord) -> bool:
        outcome = self.outcomes.pop(0) if self.outcomes else "stored"
        self.calls.append(outcome)
        if outcome == "hang":
            await asyncio.Event().wait()  # a store that never answers: only the deadline ends it
        if outcome == "error":
            raise ValueError("a failure of a kind nobody expected")
        if outcome == "transport":
            raise OSError("connection reset")
        return outcome == "stored"

    async def withdraw(self) -> None:
        self.withdrawn.set()


async def _announce(directory: ScriptedDirectory) -> None:
    announcer = Announcer(directory, lambda: peer_record("QmA"))  # type: ignore[arg-type]
    task = asyncio.create_task(announcer.run())
    try:
        async with asyncio.timeout(5.0):
            await announcer.announced.wait()
        assert not task.done()  # it survived every failed iteration
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert directory.withdrawn.is_set()


def test_a_hung_store_hits_its_deadline_and_the_next_announcement_goes_through():
    directory = ScriptedDirectory(["hang", "hang"])
    asyncio.run(_announce(directory))
    assert directory.calls == ["hang", "hang", "stored"]


def test_failed_iterations_do_not_stop_the_announcer():
    directory = ScriptedDirectory(["error", "transport", "rejected", "hang"])
    asyncio.run(_announce(directory))
    assert directory.calls == ["error", "transport", "rejected", "hang", "stored"]
