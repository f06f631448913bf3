"""A hop sends the decode steps one forward call computed for the same next hop on as a group, and the next hop
waits for exactly that group, keyed by who sent it: real handlers of two tiny peers in this process, A (0:2)
forwarding to B (2:4); the one stand-in is the network between them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
import torch

from swarm.models.blocks import Step
from swarm.models.loading import resolve_model
from swarm.peer import handlers as handlers_module
from swarm.peer.config import ExecutorConfig, SessionConfig
from swarm.peer.executor import Executor, StepResult
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer
from swarm.wire import Hop, StepAck, StepReply, StepRequest, StepWait
from tests.unit.peer.test_handlers import run_peers

pytestmark = pytest.mark.timeout(60)
CLIENTS = {"s1": "QmClientOne", "s2": "QmClientTwo"}  # two separate clients, one session each


def _handlers(peer_id: str, start: int, end: int, executor: Executor) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity(peer_id, peer_id, (f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",), 1 << 30, 6)
    peer = Peer(identity, source.spec, executor, SessionConfig())
    peer.serve(source.load_blocks(start, end, cache_tokens=512))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("client_group", [False, True])
def test_steps_computed_together_reach_the_next_hop_as_one_group_it_runs_together(
    monkeypatch: pytest.MonkeyPatch, client_group: bool
) -> None:
    """A's executor says its two decode steps (of two clients) were one forward call going on to B as a group.
    B waits for a group's missing steps for ten minutes here, so it computes them only if the group it
    expects is the one that comes: keyed by the clients (as before), it would never be complete. A step its
    client sent in a round goes on in A's group too (what ran together at A), not in the client's."""
    a = _handlers("QmA", 0, 2, Executor())
    b = _handlers("QmB", 2, 4, Executor(ExecutorConfig(batch_window_s=0.0, group_window_s=600.0)))
    spec = a.peer.spec
    sent_to_b: list[StepRequest] = []
    forward = a.peer.executor.forward

    async def a_forward(
        blocks: Any, step: Step, group: Any = None, onward: str = "", paced: bool = True, session: Any = None
    ) -> StepResult:
        result = await forward(blocks, step, group, onward, paced, session)
        decode = step.hidden.shape[0] == 1
        return replace(result, onward_group=("fromA", 2)) if decode and onward == "QmB" else result

    async def to_b(p2p: Any, peer_id: str, request: StepRequest, **_: Any) -> StepAck:
        assert peer_id == "QmB"
        sent_to_b.append(request)
        reply = await b.rpc_step(request, "QmA")
        assert isinstance(reply, StepAck)
        return reply

    async def many_to_b(p2p: Any, peer_id: str, requests: list[StepRequest], **_: Any) -> list[Any]:
        return [await to_b(p2p, peer_id, r) for r in requests]

    monkeypatch.setattr(a.peer.executor, "forward", a_forward)
    monkeypatch.setattr(handlers_module, "call_step_acked", to_b)
    monkeypatch.setattr(handlers_module, "call_step_batch", many_to_b)
    hop = Hop("QmB", ("/ip4/127.0.0.1/tcp/1/p2p/QmB",), 2, 4)

    def request(sid: str, position: int, hidden: torch.Tensor) -> StepRequest:
        base = StepRequest(sid, position, hidden, 0, 2, 16, spec.weights_hash, (hop,), 10.0, True)
        return replace(base, batch_id="round7", batch_size=2) if client_group and position else base

    async def step(sid: str, position: int, hidden: torch.Tensor) -> torch.Tensor:
        await a.rpc_step(request(sid, position, hidden), CLIENTS[sid])
        reply = await b.rpc_wait(StepWait(sid, position, 10.0), CLIENTS[sid])
        assert isinstance(reply, StepReply)
        return reply.hidden

    async def body() -> None:
        prompts = {sid: torch.randn(4, spec.hidden_size) for sid in CLIENTS}
        alone = {sid: await step(sid, 0, prompt) for sid, prompt in prompts.items()}
        assert all(r.batch_size == 1 for r in sent_to_b)  # prefills go on alone
        before = b.peer.executor.batches_run
        tokens = {sid: torch.randn(1, spec.hidden_size) for sid in CLIENTS}
        async with asyncio.timeout(30):
            outs = await asyncio.gather(*(step(sid, 4, t) for sid, t in tokens.items()))
        decode = sent_to_b[-2:]
        assert [(r.batch_id, r.batch_size) for r in decode] == [("fromA", 2)] * 2
        assert b.peer.executor.batches_run - before == 1  # one forward call for the two
        assert all(o.shape == (1, spec.hidden_size) for o in outs) and len(alone) == 2

    run_peers([a.peer, b.peer], body)


def test_a_step_computed_alone_goes_on_alone_even_if_its_client_sent_it_in_a_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's round ("round7", 2) is not passed on: the next hop would wait for a step that ran apart."""
    a = _handlers("QmA", 0, 2, Executor())
    b = _handlers("QmB", 2, 4, Executor())
    spec = a.peer.spec
    sent_to_b: list[StepRequest] = []

    async def to_b(p2p: Any, peer_id: str, request: StepRequest, **_: Any) -> StepAck:
        sent_to_b.append(request)
        reply = await b.rpc_step(request, "QmA")
        assert isinstance(reply, StepAck)
        return reply

    monkeypatch.setattr(handlers_module, "call_step_acked", to_b)
    hop = Hop("QmB", ("/ip4/127.0.0.1/tcp/1/p2p/QmB",), 2, 4)

    async def body() -> None:
        for position, tokens in ((0, 3), (3, 1)):
            base = StepRequest(
                "s1",
                position,
                torch.randn(tokens, spec.hidden_size),
                0,
                2,
                16,
                spec.weights_hash,
                (hop,),
                10.0,
                True,
            )
            await a.rpc_step(replace(base, batch_id="round7", batch_size=2), CLIENTS["s1"])
            reply = await b.rpc_wait(StepWait("s1", position, 10.0), CLIENTS["s1"])
            assert isinstance(reply, StepReply)
        assert [(r.batch_id, r.batch_size) for r in sent_to_b] == [("", 1), ("", 1)]

    run_peers([a.peer, b.peer], body)
