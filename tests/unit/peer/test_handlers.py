"""rpc_* handlers on a real tiny BlockRange (no network: steps without a route never call another peer)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.errors import CapacityError, SessionError
from swarm.models.loading import resolve_model
from swarm.peer.executor import Executor
from swarm.peer.handlers import HandlerConfig, PeerHandlers
from swarm.types import LayerRange
from swarm.wire import CloseRequest, InfoRequest, ProbeRequest, StepRequest

pytestmark = pytest.mark.timeout(60)


def _handlers(idle_timeout_s: float = 60.0) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    blocks = source.load_blocks(0, 2, cache_tokens=64)
    return PeerHandlers(
        peer_id="QmSelf",
        name="unit",
        p2p=None,  # type: ignore[arg-type]
        executor=Executor(blocks),
        spec=source.spec,
        held=LayerRange(0, 2),
        dtype=blocks.dtype,
        config=HandlerConfig(session_idle_timeout_s=idle_timeout_s),
    )


def _step(h: PeerHandlers, sid: str, position: int, tokens: int, max_length: int = 32) -> StepRequest:
    hidden = torch.randn(tokens, h.spec.hidden_size)
    return StepRequest(sid, position, hidden, 0, 2, max_length, h.spec.weights_hash)


def test_sessions_open_implicitly_count_against_the_budget_and_expire_when_idle() -> None:
    h = _handlers(idle_timeout_s=0.3)

    async def body() -> None:
        tasks = [asyncio.create_task(h.executor.run()), asyncio.create_task(h.run())]
        try:
            reply = await h.rpc_step(_step(h, "s1", 0, 4), "QmClient")
            assert reply.hidden.shape == (4, h.spec.hidden_size) and reply.timings[0].peer_id == "QmSelf"
            await h.rpc_step(_step(h, "s1", 4, 1), "QmClient")
            info = await h.rpc_info(InfoRequest(), "QmClient")
            assert (info.active_sessions, info.free_cache_tokens, info.cache_tokens_total) == (1, 32, 64)
            with pytest.raises(CapacityError, match="free"):
                await h.rpc_step(_step(h, "s2", 0, 1, max_length=40), "QmClient")
            with pytest.raises(SessionError, match="unknown session"):
                await h.rpc_step(_step(h, "never-opened", 3, 1), "QmClient")
            await asyncio.sleep(0.8)  # idle timeout: the reaper closes s1 and frees its cache
            assert h.sessions == {} and h.free_cache_tokens == 64
            with pytest.raises(SessionError):
                await h.rpc_step(_step(h, "s1", 5, 1), "QmClient")
            assert (await h.rpc_close(CloseRequest("s1"), "QmClient")).closed is False
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(body())


def test_draining_refuses_new_sessions_and_closes_the_rest() -> None:
    h = _handlers()

    async def body() -> None:
        task = asyncio.create_task(h.executor.run())
        try:
            await h.rpc_step(_step(h, "open", 0, 2), "QmClient")
            drain = asyncio.create_task(h.drain(grace_s=0.5))
            await asyncio.sleep(0.1)
            with pytest.raises(CapacityError, match="leaving"):
                await h.rpc_step(_step(h, "new", 0, 1), "QmClient")
            await h.rpc_step(_step(h, "open", 2, 1), "QmClient")  # an open session may still finish
            await drain
            assert h.sessions == {} and h.free_cache_tokens == 64
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(body())


def test_probe_echoes_sizes() -> None:
    h = _handlers()
    reply = asyncio.run(h.rpc_probe(ProbeRequest(payload=b"x" * 1000, reply_bytes=10), "QmClient"))
    assert (reply.peer_id, reply.received_bytes, reply.payload, reply.dial_back_ok) == (
        "QmSelf",
        1000,
        bytes(10),
        None,
    )
