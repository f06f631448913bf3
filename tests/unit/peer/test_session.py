"""A session's state has one owner: its Session in the Peer's table holds its reservation, its output log, the
executor's bookkeeping of its steps and its hand-over state, and closing it drops all of it."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ProtocolError, SessionError
from swarm.models.blocks import Step
from swarm.models.loading import resolve_model
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.handover import Snapshot, chunks, read_session
from swarm.peer.state import Identity, Peer, session_key
from swarm.wire import StepRequest
from tests.unit.peer.test_handlers import run_peers

pytestmark = pytest.mark.timeout(60)
CLIENT = "QmClient"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _handlers(name: str, clock: _Clock | None = None) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity(name, name, (f"/ip4/127.0.0.1/tcp/1/p2p/{name}",), 1 << 30, 6)
    peer = Peer(
        identity, source.spec, Executor(), SessionConfig(idle_timeout_s=120.0), clock=clock or _Clock()
    )
    peer.serve(source.load_blocks(0, 2, cache_tokens=64))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


def _step(h: PeerHandlers, position: int, hidden: torch.Tensor, sid: str = "s1") -> StepRequest:
    return StepRequest(sid, position, hidden, 0, 2, 32, h.peer.spec.weights_hash)


def test_closing_a_session_drops_its_log_its_failed_step_and_its_pace_in_one_place() -> None:
    h = _handlers("QmA")
    key = session_key(CLIENT, "s1")
    torch.manual_seed(0)
    prompt = torch.randn(3, h.peer.spec.hidden_size)

    async def body() -> None:
        await h.rpc_step(_step(h, 0, prompt), CLIENT)
        await h.rpc_step(_step(h, 3, prompt[:1]), CLIENT)
        session, served = h.peer.session(key), h.peer.find(key)
        assert session is not None and served is not None
        assert session.sent.length == 4, "its output log"
        assert len(h.peer.executor.schedule.arrivals) == 1, "its pace"
        bad = Step(key, prompt[:1].double(), 0, 2, 4)  # a wrong dtype fails in the forward call
        with pytest.raises(ProtocolError):
            await h.peer.executor.forward(served.blocks, bad, session=session.steps)
        assert session.steps.failed == 4, "the executor's mark of its failed step is on the session"
        assert await h.peer.close(key)
        assert h.peer.session(key) is None and h.peer.session_count == 0
        assert len(h.peer.executor.schedule.arrivals) == 0
        assert not h.peer.executor._transient, "the executor keeps nothing of it"
        # the same key opens afresh: no failure, no log carried over from the closed session
        await h.rpc_step(_step(h, 0, prompt), CLIENT)
        again = h.peer.session(key)
        assert again is not None and again is not session
        assert again.steps.failed is None and again.sent.length == 3

    run_peers([h.peer], body)


def test_a_half_sent_hand_over_goes_with_its_session() -> None:
    """The receiver got the first chunk of a session's cache, then the session was closed (reaped): the next
    chunk finds no hand-over under way, and a new first chunk opens it again."""
    a, b = _handlers("QmA"), _handlers("QmB")
    key = session_key(CLIENT, "s1")
    prompt = torch.randn(4, a.peer.spec.hidden_size)

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        snapshot = read_session(a.peer.current.blocks, key)  # type: ignore[union-attr]
        assert isinstance(snapshot, Snapshot)
        requests = chunks(snapshot, "s1", CLIENT, a.peer.spec.weights_hash)
        assert len(requests) == 2  # one per layer
        assert not (await b.rpc_handover(requests[0], "QmA")).installed
        session = b.peer.session(key)
        assert session is not None and session.handover.incoming is not None
        assert await b.peer.close(key)
        with pytest.raises(SessionError, match="no hand-over"):
            await b.rpc_handover(requests[1], "QmA")
        for request in requests:
            installed = (await b.rpc_handover(request, "QmA")).installed
        assert installed and b.peer.session(key).handover.incoming is None  # type: ignore[union-attr]

    run_peers([a.peer, b.peer], body)


def test_moved_sessions_are_remembered_for_the_idle_timeout_not_by_count() -> None:
    clock = _Clock()
    h = _handlers("QmA", clock)
    for i in range(5000):  # more than any count cap would keep
        h.handover._remember_moved(f"s{i}@{CLIENT}", "QmB")
    assert len(h.handover.moved) == 5000
    clock.now += 121.0  # past the idle timeout: their clients would find them expired here anyway
    h.handover._remember_moved(f"late@{CLIENT}", "QmC")
    assert list(h.handover.moved) == [f"late@{CLIENT}"]
