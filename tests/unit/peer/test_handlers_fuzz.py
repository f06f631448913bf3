"""Property-based fuzzing of rpc_step / rpc_close on a real tiny Peer: random, colliding, foreign and unknown
sessions from several remotes, wrong positions, layers, sizes, dtypes, models and routes. Only SwarmError
subclasses may come out, and afterwards the peer still serves an honest step and has leaked no cache.

Routes name peers whose ids are not valid libp2p ids, so a forward fails in this process (ProtocolError)
without any network.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import SwarmError
from swarm.peer.config import SessionConfig
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Status
from swarm.wire import CloseRequest, Hop, StepRequest, StepWait
from tests.unit.peer.test_handlers import Clock, _handlers

pytestmark = pytest.mark.timeout(120)

REMOTES = ["QmAlice", "QmBob", "QmSelf", "QmMallory"]
SESSIONS = ["s0", "s1", "s2", "s3", ""]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Fixture:
    """One tiny Peer and its executor on a private event loop, shared by every example of a test."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.h: PeerHandlers = _handlers(self.clock, idle_timeout_s=60.0, cache_tokens=64)
        # order_wait_s is real time: a step of an unknown session at a position past 0 waits that long for
        # a first step that never comes (each example runs its actions one after another).
        self.h.peer.config = SessionConfig(idle_timeout_s=60.0, max_sessions_per_remote=3, order_wait_s=0.001)
        self.loop = asyncio.new_event_loop()
        self.executor_task = self.loop.create_task(self.h.peer.executor.run())
        self.cases = 0
        self.served = 0  # calls that got a reply, not an error

    def run(self, coro: object) -> object:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    def close(self) -> None:
        self.executor_task.cancel()
        self.loop.run_until_complete(asyncio.gather(self.executor_task, return_exceptions=True))
        self.loop.close()


@pytest.fixture
def fx() -> Iterator[Fixture]:
    fixture = Fixture()
    yield fixture
    fixture.close()


def _hops() -> st.SearchStrategy[tuple[Hop, ...]]:
    hop = st.builds(
        Hop,
        st.sampled_from(["Qm0B", "QmSelf", "QmAlice", "0x"]),
        st.just(()),
        st.integers(0, 7),
        st.integers(1, 8),
    )
    return st.lists(hop, max_size=3).map(tuple)


@st.composite
def steps(draw: st.DrawFn, hidden_size: int, model_hash: str) -> StepRequest:
    """Half plausible (right model, size and layers, no route: they reach the cache), half anything."""
    sane = draw(st.booleans())
    tokens = draw(st.integers(1, 5))
    size = hidden_size if sane else draw(st.sampled_from([hidden_size, hidden_size - 1, 1]))
    hidden = torch.randn(tokens, size).to(draw(st.sampled_from(DTYPES)))
    start = 0 if sane else draw(st.integers(0, 6))
    end = 2 if sane else draw(st.integers(start + 1, 8))
    return StepRequest(
        session_id=draw(st.sampled_from(SESSIONS)),
        position=draw(st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 70))),
        hidden=hidden,
        start=start,
        end=end,
        max_length_tokens=draw(st.sampled_from([8, 16, 1, 4, 32, 33, 64, 65, 1 << 20])),
        model_hash=model_hash if sane else draw(st.sampled_from([model_hash, "other"])),
        route_rest=() if sane else draw(_hops()),
        # a step past the session's length waits for the steps before it up to its deadline (they may still be
        # on their way): short here, where they never come (with the default 60 s one example took a minute)
        timeout_s=0.05,
    )


async def _cancelled_step(h: PeerHandlers, remote: str, turns: int) -> None:
    hidden = torch.randn(2, h.peer.spec.hidden_size)
    request = StepRequest("cancelled", 0, hidden, 0, 2, 8, h.peer.spec.weights_hash)
    task = asyncio.create_task(h.rpc_step(request, remote))
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await h.peer.executor.call(lambda: None)  # whatever the cancelled step left queued has run


def _assert_nothing_leaked(fx: Fixture) -> None:
    """Once every session has expired, the whole cache is free again."""
    fx.clock.now += 10_000
    fx.run(fx.h.peer.reap())
    current = fx.h.peer.current
    assert current is not None and fx.h.peer.session_count == 0
    assert current.blocks.active_sessions == [] and current.blocks.free_cache_tokens == 64


FUZZ = settings(max_examples=500, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def test_rpc_step_and_close_raise_only_swarm_errors_and_the_peer_keeps_serving(fx: Fixture) -> None:
    h, spec = fx.h, fx.h.peer.spec

    @FUZZ
    @given(
        actions=st.lists(
            st.one_of(
                st.tuples(
                    st.just("step"), steps(spec.hidden_size, spec.weights_hash), st.sampled_from(REMOTES)
                ),
                st.tuples(st.just("close"), st.sampled_from(SESSIONS), st.sampled_from(REMOTES)),
                st.tuples(st.just("wait"), st.integers(0, 90), st.just("")),
                st.tuples(  # a client's wait for a step's output: no step comes, it ends at its deadline
                    st.just("result"),
                    st.builds(StepWait, st.sampled_from(SESSIONS), st.integers(-5, 2**40), st.just(0.002)),
                    st.sampled_from(REMOTES),
                ),
                st.tuples(st.just("cancel"), st.integers(0, 6), st.sampled_from(REMOTES)),
            ),
            min_size=1,
            max_size=6,
        )
    )
    def fuzz(actions: list[tuple[str, object, str]]) -> None:
        for action, arg, remote in actions:
            fx.cases += 1
            try:
                if action == "step":
                    assert isinstance(arg, StepRequest)
                    fx.run(h.rpc_step(arg, remote))
                    fx.served += 1
                elif action == "cancel":  # a caller that gives up after a few loop turns
                    fx.run(_cancelled_step(h, remote, int(arg)))  # type: ignore[call-overload]
                elif action == "result":
                    assert isinstance(arg, StepWait)
                    fx.run(h.rpc_wait(arg, remote))
                elif action == "close":
                    fx.run(h.rpc_close(CloseRequest(str(arg)), remote))
                else:
                    fx.clock.now += float(arg)  # type: ignore[arg-type]
                    fx.run(h.peer.reap())
            except SwarmError:
                pass  # anything else fails the test
        _assert_nothing_leaked(fx)

    fuzz()
    print(f"rpc fuzz: {fx.cases} calls, {fx.served} steps served")
    current = h.peer.current
    assert current is not None and h.peer.status is Status.SERVING
    honest = StepRequest("fresh", 0, torch.randn(3, spec.hidden_size), 0, 2, 8, spec.weights_hash)
    reply = fx.run(h.rpc_step(honest, "QmAlice"))
    assert reply.hidden.shape == (3, spec.hidden_size)  # type: ignore[attr-defined]
