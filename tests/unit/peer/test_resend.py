"""A failover's resend (swarm.peer.outputs) on real handlers of two tiny peers in this process: a hop logs what it
sends on, and resends it, without computing, to a replacement of the hop after it. The one stand-in is the
network between the two: ``call_step_acked`` is pointed at the other peer's handler."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from swarm.errors import ProtocolError, SessionError
from swarm.models.blocks import Step
from swarm.models.loading import resolve_model
from swarm.peer import handlers as handlers_module
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor, StepResult
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer
from swarm.wire import Hop, StepAck, StepReply, StepRequest, StepWait
from tests.unit.peer.test_handlers import run_peers

pytestmark = pytest.mark.timeout(60)
CLIENT = "QmClient"


def _handlers(peer_id: str, start: int, end: int) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity(peer_id, peer_id, (f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig())
    peer.serve(source.load_blocks(start, end, cache_tokens=64))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


class Swarm:
    """Peer A (layers 0:2) forwarding to whichever handler is named ``QmB`` (layers 2:4)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.a = _handlers("QmA", 0, 2)
        self.b = _handlers("QmB", 2, 4)
        self.spec = self.a.peer.spec
        self.a_steps: list[tuple[int, int]] = []  # (position, tokens) of every step A's executor ran
        forward = self.a.peer.executor.forward

        async def spy(
            blocks: Any,
            step: Step,
            group: Any = None,
            onward: str = "",
            paced: bool = True,
            session: Any = None,
        ) -> StepResult:
            self.a_steps.append((step.position, step.hidden.shape[0]))
            return await forward(blocks, step, group, onward, paced, session)

        async def to_b(p2p: Any, peer_id: str, request: StepRequest, **_: Any) -> StepAck:
            assert peer_id == "QmB"
            reply = await self.b.rpc_step(request, "QmA")
            assert isinstance(reply, StepAck)
            return reply

        monkeypatch.setattr(self.a.peer.executor, "forward", spy)
        monkeypatch.setattr(handlers_module, "call_step_acked", to_b)

    def request(self, position: int, hidden: torch.Tensor, resend_tokens: int = 0) -> StepRequest:
        hop = Hop("QmB", ("/ip4/127.0.0.1/tcp/1/p2p/QmB",), 2, 4)
        return StepRequest(
            "s1", position, hidden, 0, 2, 32, self.spec.weights_hash, (hop,), 10.0, True, "", resend_tokens
        )

    async def step(self, position: int, hidden: torch.Tensor, resend_tokens: int = 0) -> torch.Tensor:
        """A step from the client through A and B; B's output, from the client's wait."""
        await self.a.rpc_step(self.request(position, hidden, resend_tokens), CLIENT)
        reply = await self.b.rpc_wait(StepWait("s1", position, 10.0), CLIENT)
        assert isinstance(reply, StepReply)
        return reply.hidden

    def run(self, body: Callable[[], Awaitable[None]]) -> None:
        run_peers([self.a.peer, self.b.peer], body)


def test_a_replacement_hop_filled_by_a_resend_continues_like_the_hop_it_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swarm = Swarm(monkeypatch)
    prompt, token, after = (torch.randn(n, swarm.spec.hidden_size) for n in (5, 1, 1))

    async def body() -> None:
        await swarm.step(0, prompt)
        await swarm.step(5, token)
        expected = await swarm.step(6, after)  # what B computes for the next token, cache intact
        swarm.b = _handlers("QmB", 2, 4)  # B restarted (or was replaced): it knows nothing of the session
        runner = asyncio.create_task(swarm.b.peer.executor.run())
        try:
            steps_before = list(swarm.a_steps)
            with pytest.raises(SessionError):
                await swarm.step(6, after)  # the new B cannot take the step: it lacks the prefix
            swarm.a_steps = steps_before  # (A computed that step; only the resend is under test)
            await swarm.step(0, torch.empty(0, swarm.spec.hidden_size), resend_tokens=6)
            assert swarm.a_steps == steps_before, "a resend computes nothing on the hop that sends it"
            assert swarm.b.peer.find("s1@QmClient") is not None  # keyed by the client, not by A
            got = await swarm.step(6, after)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        torch.testing.assert_close(got, expected)

    swarm.run(body)


def test_a_resend_needs_a_log_of_the_client_s_own_session_and_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    swarm = Swarm(monkeypatch)
    empty = torch.empty(0, swarm.spec.hidden_size)

    async def body() -> None:
        with pytest.raises(SessionError, match="no session"):
            await swarm.a.rpc_step(swarm.request(0, empty, 3), CLIENT)
        await swarm.step(0, torch.randn(4, swarm.spec.hidden_size))
        with pytest.raises(SessionError, match="no log"):
            await swarm.a.rpc_step(swarm.request(0, empty, 5), CLIENT)  # A sent on only 4
        with pytest.raises(SessionError, match="no session"):
            await swarm.a.rpc_step(swarm.request(0, empty, 4), "QmStranger")  # not its session
        unwaited = StepRequest(**{**swarm.request(0, empty, 4).__dict__, "wait_result": False})
        with pytest.raises(ProtocolError, match="wait_result"):
            await swarm.a.rpc_step(unwaited, CLIENT)
        assert swarm.a_steps == [(0, 4)]

    swarm.run(body)
