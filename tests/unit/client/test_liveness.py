"""client.liveness: a step that runs long makes the client probe the route; a silent peer ends the step at once.

Steps here are futures the test resolves itself, and the watch's bound is tiny: nothing waits on wall-clock
time for an outcome, and the step timeout is an hour, so only the probe can end a hung step in the test's time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from client.liveness import LivenessConfig, PeerSilent, StepWatch
from client.retry import Action, RetryPolicy
from swarm.routing.route import Stage
from swarm.types import LayerRange, NodeID

pytestmark = pytest.mark.timeout(10)

HOUR_S = 3600.0
STAGES = (Stage(NodeID("a"), LayerRange(0, 2)), Stage(NodeID("b"), LayerRange(2, 4)))
FAST = LivenessConfig(probe_factor=4.0, min_probe_after_s=0.001, probe_timeout_s=0.001)


class Probe:
    """Answers each probe with the next of `answers` (None: everybody answered), recording the calls."""

    def __init__(self, *answers: NodeID | None) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[NodeID, ...]] = []
        self.called = asyncio.Event()

    async def __call__(self, stages: Sequence[Stage], timeout_s: float) -> NodeID | None:
        self.calls.append(tuple(s.peer_id for s in stages))
        self.called.set()
        return self.answers.pop(0) if self.answers else None


def test_a_hung_step_ends_with_peer_silent_naming_the_peer_the_probe_found() -> None:
    async def scenario() -> tuple[PeerSilent, bool]:
        probe = Probe(None, NodeID("b"))  # the first probe finds all alive, the second finds b silent
        watch = StepWatch(probe, FAST)
        hung: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(PeerSilent) as info:
            await watch.run(hung, STAGES, 1, HOUR_S)
        assert probe.calls == [("a", "b"), ("a", "b")] and watch.probes == 2 and watch.silent_found == 1
        return info.value, hung.cancelled()

    error, cancelled = asyncio.run(scenario())
    assert error.failed_peer_id == "b"
    assert cancelled  # the abandoned step is cancelled, not left running
    assert RetryPolicy(max_retries=3, retry_delay_s=1.0).decide(error, 0).action is Action.WITHDRAW
    assert RetryPolicy(max_retries=3, retry_delay_s=1.0).decide(error, 0).delay_s == 0.0


def test_a_slow_step_whose_peers_answer_is_waited_for() -> None:
    async def scenario() -> tuple[int, StepWatch]:
        probe = Probe()  # everybody always answers
        watch = StepWatch(probe, FAST)
        slow: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def finish_after_a_probe() -> None:
            await probe.called.wait()
            slow.set_result(7)

        finisher = asyncio.create_task(finish_after_a_probe())
        result = await watch.run(slow, STAGES, 1, HOUR_S)
        await finisher
        return result, watch

    result, watch = asyncio.run(scenario())
    assert result == 7 and watch.probes >= 1 and watch.silent_found == 0


def test_errors_and_the_deadline_pass_through() -> None:
    async def scenario() -> None:
        watch = StepWatch(Probe(), FAST)
        failed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        failed.set_exception(ConnectionResetError("reset"))
        with pytest.raises(ConnectionResetError):
            await watch.run(failed, STAGES, 1, HOUR_S)
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await watch.run(never, STAGES, 1, 0.0)

    asyncio.run(scenario())


def test_the_bound_follows_the_expected_step_time_but_never_drops_below_the_minimum() -> None:
    now = [0.0]
    watch = StepWatch(Probe(), LivenessConfig(probe_factor=4.0, min_probe_after_s=1.0), clock=lambda: now[0])
    assert watch.bound_s(1) == 1.0 and watch.bound_s(100) == 1.0  # nothing observed yet: the minimum

    async def step_taking(seconds: float, tokens: int) -> None:
        async def step() -> None:
            now[0] += seconds  # the injected clock moves as if the step took `seconds`

        await watch.run(step(), STAGES, tokens, HOUR_S)

    asyncio.run(step_taking(0.5, 1))
    assert watch.bound_s(1) == pytest.approx(2.0)  # 4 x 0.5 s
    asyncio.run(step_taking(0.01, 1))
    assert 1.0 <= watch.bound_s(1) < 2.0  # a running average: one fast step lowers it, not to the floor
    asyncio.run(step_taking(3.0, 100))  # 30 ms per token of a prefill
    assert watch.bound_s(200) == pytest.approx(4.0 * 0.03 * 200)
    assert watch.bound_s(1) < 2.0  # decode and prefill are averaged apart


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="probe_factor"):
        LivenessConfig(probe_factor=0.5)
    with pytest.raises(ValueError, match="probe_timeout_s"):
        LivenessConfig(probe_timeout_s=0.0)
