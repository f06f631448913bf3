"""A peer's activation codecs (swarm.codec): the form its output takes to the next hop, chosen by its setting
and its measured link; a lossless step exact whatever the setting; a wait answered in the form it asks; and
lighter states arriving converted to the peer's compute dtype. A real tiny peer, no network (the next hop's
call is replaced by one that records what it was sent)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from swarm.codec import ActivationConfig
from swarm.dht import LinkMeasure
from swarm.peer import handlers as handlers_module
from swarm.peer.config import SessionConfig
from swarm.peer.handlers import PeerHandlers
from swarm.peer.measure import ComputeMeasure
from swarm.wire import (
    Hop,
    StepAck,
    StepReply,
    StepRequest,
    StepWait,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from tests.unit.peer.test_handlers import Clock, _handlers, _step, run_peers

pytestmark = pytest.mark.timeout(60)

NEXT = Hop("QmNext", ("/ip4/127.0.0.1/tcp/1/p2p/QmNext",), 2, 4)


class NextHop:
    """Stands in for the call to NEXT: records each step sent there and acknowledges it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[StepRequest] = []
        monkeypatch.setattr(handlers_module, "call_step_acked", self.call)

    async def call(self, p2p: object, peer_id: str, request: StepRequest, **_: object) -> StepAck:
        self.sent.append(request)
        return StepAck()

    async def forward(self, h: PeerHandlers, hidden: torch.Tensor, **fields: object) -> StepRequest:
        """What ``h`` sends on to NEXT for a new session's one-token step of ``hidden``."""
        step = replace(
            _step(h, f"s{len(self.sent)}", 0, 1, max_length=8),
            hidden=hidden,
            route_rest=(NEXT,),
            wait_result=True,
        )
        assert isinstance(await h.rpc_step(replace(step, **fields), "QmClient"), StepAck)  # type: ignore[arg-type]
        return self.sent[-1]


def _set(h: PeerHandlers, mode: str) -> None:
    h.config = SessionConfig(activations=ActivationConfig(mode=mode, auto_fraction=0.25))


@pytest.mark.parametrize("mode", ["exact", "f16", "q8"])
def test_a_hop_sends_its_output_on_in_the_codec_it_is_set_to(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    h, next_hop = _handlers(Clock(), cache_tokens=1024), NextHop(monkeypatch)
    _set(h, mode)
    hidden = torch.randn(1, h.peer.spec.hidden_size)

    async def body() -> None:
        sent = await next_hop.forward(h, hidden)
        assert sent.codec == mode and sent.hidden.dtype == torch.float32 and (sent.start, sent.end) == (2, 4)
        arrived = decode_request(encode_request(sent))
        assert isinstance(arrived, StepRequest) and arrived.codec == mode
        error = float((arrived.hidden.float() - sent.hidden).norm() / sent.hidden.norm())
        assert error == 0 if mode == "exact" else 0 < error < 0.02
        pinned = await next_hop.forward(h, hidden, lossless=True)
        assert pinned.codec == "exact" and pinned.lossless, "a spot-check's step goes exact on every hop"

    run_peers([h.peer], body)


def test_auto_goes_lighter_as_the_measured_link_to_the_next_hop_slows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h, next_hop = _handlers(Clock(), cache_tokens=1024), NextHop(monkeypatch)
    _set(h, "auto")
    hidden = torch.randn(1, h.peer.spec.hidden_size)  # 64 float32 values: 256 bytes, 128 in f16, 82 in q8
    chosen = {}

    async def body() -> None:
        assert (await next_hop.forward(h, hidden)).codec == "exact", "nothing measured yet"
        # The next hop's 2 layers at 1000 tokens/s each: 2 ms a token, a quarter of it for the transfer.
        h.peer.compute = ComputeMeasure(100.0, 400.0, 1000.0)
        for bandwidth in (1e6, 3e5, 1e5):
            h.peer.links = {NEXT.peer_id: LinkMeasure(rtt_s=0.01, bandwidth_bytes_s=bandwidth)}
            chosen[bandwidth] = (await next_hop.forward(h, hidden)).codec

    run_peers([h.peer], body)
    assert chosen == {1e6: "exact", 3e5: "f16", 1e5: "q8"}


def test_the_last_hop_answers_a_wait_in_the_codec_it_asks_for() -> None:
    h = _handlers(Clock(), cache_tokens=1024)
    hidden = torch.randn(1, h.peer.spec.hidden_size)
    outputs = {}

    async def body() -> None:
        for codec in ("exact", "q8"):
            step = replace(_step(h, codec, 0, 1, max_length=8), hidden=hidden, wait_result=True)
            assert isinstance(await h.rpc_step(step, "QmClient"), StepAck)
            reply = await h.rpc_wait(StepWait(codec, 0, 10.0, codec), "QmClient")
            assert reply.codec == codec
            outputs[codec] = decode_reply(encode_reply(reply))

    run_peers([h.peer], body)
    exact, q8 = outputs["exact"], outputs["q8"]
    assert isinstance(exact, StepReply) and isinstance(q8, StepReply) and q8.codec == "q8"
    assert 0 < float((q8.hidden - exact.hidden).norm() / exact.hidden.norm()) < 0.02


def test_lighter_states_that_arrive_run_in_the_peers_dtype() -> None:
    h = _handlers(Clock(), cache_tokens=1024)
    hidden = torch.randn(3, h.peer.spec.hidden_size)
    replies = {}

    async def body() -> None:
        for codec in ("exact", "f16", "q8"):
            sent = replace(_step(h, codec, 0, 3, max_length=8), hidden=hidden, codec=codec)
            arrived = decode_request(encode_request(sent))
            assert isinstance(arrived, StepRequest) and arrived.codec == codec
            replies[codec] = await h.rpc_step(arrived, "QmClient")

    run_peers([h.peer], body)
    exact = replies["exact"]
    assert isinstance(exact, StepReply)
    for codec in ("f16", "q8"):
        reply = replies[codec]
        assert isinstance(reply, StepReply) and reply.hidden.dtype == exact.hidden.dtype == torch.float32
        assert reply.codec == "exact", "a relayed answer goes back exact"
        assert 0 < float((reply.hidden - exact.hidden).norm() / exact.hidden.norm()) < 0.05
