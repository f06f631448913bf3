"""Steps of one session arriving out of order (a prompt pipelined in chunks, client/session.py) run in position
order on a peer: real handlers, Peer and executor on a tiny BlockRange, no network. Arrival order is the order
the tasks are created in (each runs to its first wait before the next starts); no sleeps."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.models.blocks import BlockRange, Step
from swarm.models.loading import resolve_model
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer
from swarm.wire import StepReply, StepRequest

pytestmark = pytest.mark.timeout(60)

CHUNKS = [(0, 5), (5, 4), (9, 3)]  # (position, tokens) of a 12-token prompt
NEXT = 12  # the decode step after it


@pytest.fixture
def handlers() -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity("QmSelf", "unit", ("/ip4/127.0.0.1/tcp/1/p2p/QmSelf",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig(order_wait_s=30.0))
    peer.serve(source.load_blocks(0, 2, cache_tokens=4096))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


def _prompt(h: PeerHandlers, tokens: int = 13) -> torch.Tensor:
    return torch.randn(tokens, h.peer.spec.hidden_size, generator=torch.Generator().manual_seed(3))


def _request(h: PeerHandlers, sid: str, position: int, hidden: torch.Tensor) -> StepRequest:
    return StepRequest(sid, position, hidden, 0, 2, 32, h.peer.spec.weights_hash)


async def _serving(h: PeerHandlers) -> asyncio.Task[None]:
    return asyncio.create_task(h.peer.executor.run())


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_chunks_arriving_in_any_order_give_the_unchunked_output(handlers: PeerHandlers) -> None:
    """Every arrival order of three chunks: the same outputs as the whole prompt in one step, and the same
    cache (the decode step after the prompt agrees too). Without reordering a chunk ahead of its turn fails
    (unknown session, or a cache shorter than its position)."""
    h, prompt = handlers, _prompt(handlers)

    async def main() -> None:
        runner = await _serving(h)
        try:
            whole = (await h.rpc_step(_request(h, "whole", 0, prompt[:NEXT]), "QmClient")).hidden
            after = (await h.rpc_step(_request(h, "whole", NEXT, prompt[NEXT:]), "QmClient")).hidden
            for n, order in enumerate(itertools.permutations(range(len(CHUNKS)))):
                sid = f"s{n}"
                tasks = {
                    i: asyncio.create_task(
                        h.rpc_step(
                            _request(h, sid, CHUNKS[i][0], prompt[CHUNKS[i][0] : sum(CHUNKS[i])]), "Qm"
                        )
                    )
                    for i in order
                }
                outputs = [(await tasks[i]).hidden for i in range(len(CHUNKS))]
                torch.testing.assert_close(torch.cat(outputs), whole, atol=1e-5, rtol=1e-5, msg=str(order))
                decode = (await h.rpc_step(_request(h, sid, NEXT, prompt[NEXT:]), "Qm")).hidden
                torch.testing.assert_close(decode, after, atol=1e-5, rtol=1e-5, msg=str(order))
                assert await h.peer.close(f"{sid}@Qm")
        finally:
            await _stop(runner)

    asyncio.run(main())


def test_chunks_waiting_behind_a_failed_first_step_fail_at_once(handlers: PeerHandlers) -> None:
    """The first step's open fails (it asks for more cache than the peer may give): the chunks that came
    before it and wait for the session fail with SessionError at once, and so does one that comes after it,
    not after order_wait_s (30 s here, past the test's timeout)."""
    h, prompt = handlers, _prompt(handlers)

    def chunk(i: int) -> asyncio.Task[StepReply]:
        position, tokens = CHUNKS[i]
        return asyncio.create_task(
            h.rpc_step(_request(h, "big", position, prompt[position : position + tokens]), "Qm")
        )

    async def main() -> None:
        runner = await _serving(h)
        try:
            early = chunk(1)
            first = StepRequest("big", 0, prompt[:5], 0, 2, 1 << 19, h.peer.spec.weights_hash)
            with pytest.raises(CapacityError, match="cache"):
                await asyncio.create_task(h.rpc_step(first, "Qm"))
            late = chunk(2)
            for task in (early, late):
                with pytest.raises(SessionError, match="first step failed"):
                    await task
            assert h.peer.session_count == 0
        finally:
            await _stop(runner)

    asyncio.run(main())


def test_steps_waiting_behind_a_step_that_failed_in_the_executor_fail_at_once() -> None:
    """On the executor itself: a step at position 5 waits for the cache to reach 5; the step at 0 fails
    (wrong dtype), so the waiting one fails too; a good replay of both then runs, in order."""
    torch.set_num_threads(1)
    blocks: BlockRange = resolve_model("tiny").load_blocks(0, 2, cache_tokens=512)
    executor = Executor()
    hidden = torch.randn(9, blocks.spec.hidden_size, generator=torch.Generator().manual_seed(1))

    async def main() -> None:
        runner = asyncio.create_task(executor.run())
        try:
            await executor.call(lambda: blocks.open_session("s", 16))
            waiting = asyncio.create_task(executor.forward(blocks, Step("s", hidden[5:], 0, 2, 5)))
            with pytest.raises(ProtocolError, match="dtype"):
                await executor.forward(blocks, Step("s", hidden[:5].double(), 0, 2, 0))
            with pytest.raises(SessionError, match="position 0 failed"):
                await waiting
            second = asyncio.create_task(executor.forward(blocks, Step("s", hidden[5:], 0, 2, 5)))
            first = await executor.forward(blocks, Step("s", hidden[:5], 0, 2, 0))
            replay = torch.cat([first.hidden, (await second).hidden])
        finally:
            await _stop(runner)
        blocks.open_session("ref", 16)
        (whole,) = blocks.forward([Step("ref", hidden, 0, 2, 0)])
        torch.testing.assert_close(replay, whole, atol=1e-5, rtol=1e-5)

    asyncio.run(main())
