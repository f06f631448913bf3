"""A session of a family whose heads are wider than hidden / heads (Gemma 2: 4 heads of 32 in a hidden size of
64) hands its KV cache over to another in-process peer through the real wire encoding, past its 8-token window,
and the successor's next step gives the same output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.models.loading import ModelSource, resolve_model
from swarm.peer import handover as handover_module
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer, session_key
from swarm.testing.families import GEMMA2_WINDOW, write_tiny_family
from swarm.wire import StepRequest
from tests.unit.peer.test_handover import CLIENT, _run, _wired

pytestmark = pytest.mark.timeout(60)


def _handlers(source: ModelSource, name: str) -> PeerHandlers:
    torch.set_num_threads(1)
    identity = Identity(name, name, (f"/ip4/127.0.0.1/tcp/1/p2p/{name}",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig())
    peer.serve(source.load_blocks(0, 2, cache_tokens=64))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


def test_a_gemma2_session_hands_over_its_wide_heads_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = resolve_model(str(write_tiny_family(tmp_path / "gemma2", "gemma2")))
    assert source.spec.head_dim * source.spec.num_heads != source.spec.hidden_size
    a, b = _handlers(source, "QmA"), _handlers(source, "QmB")
    sent: list[int] = []
    monkeypatch.setattr(handover_module, "call_handover", _wired(b, sent))
    monkeypatch.setattr(handover_module, "CHUNK_BYTES", 1024)
    generator = torch.Generator().manual_seed(0)
    prompt_tokens = GEMMA2_WINDOW + 4  # the sliding layer's window has dropped the first keys by then
    prompt = torch.randn(prompt_tokens, source.spec.hidden_size, generator=generator)
    nxt = torch.randn(1, source.spec.hidden_size, generator=generator)

    def step(h: PeerHandlers, position: int, hidden: torch.Tensor) -> StepRequest:
        return StepRequest("s1", position, hidden, 0, 2, 32, h.peer.spec.weights_hash)

    async def body() -> None:
        await a.rpc_step(step(a, 0, prompt), CLIENT)
        expected = (await a.rpc_step(step(a, prompt_tokens, nxt), CLIENT)).hidden  # type: ignore[union-attr]
        served = a.peer.find(session_key(CLIENT, "s1"))
        assert served is not None
        assert await a.handover.hand_over_all([served], {"QmB": b.peer.record()}) == 1
        assert len(sent) > 2
        got = (await b.rpc_step(step(b, prompt_tokens, nxt), CLIENT)).hidden  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected)

    _run([a, b], body)
