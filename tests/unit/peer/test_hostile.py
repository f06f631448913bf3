"""Hostile requests at a peer's RPC boundary, on a real tiny Peer (no network: nothing here reaches a next hop).

Routes that multiply work, probes used as port scanners or traffic amplifiers, sessions stepped or closed by
someone else, one remote squatting the KV cache, reservations leaked by cancelled opens.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from swarm.errors import ProtocolError
from swarm.peer.handlers import DIAL_BACK_FAILED
from swarm.types import LayerRange
from swarm.wire import MAX_PROBE_BYTES, Hop, ProbeRequest
from tests.unit.peer.test_handlers import Clock, _handlers, _run, _step

pytestmark = pytest.mark.timeout(60)


def _hops(*spans: tuple[str, int, int]) -> tuple[Hop, ...]:
    return tuple(Hop(peer, (), start, end) for peer, start, end in spans)


@pytest.mark.parametrize(
    ("end", "route", "match"),
    [
        (1, _hops(("QmB", 1, 2), ("QmSelf", 2, 3), ("QmB", 3, 4)), "twice"),  # A, B, A, B: 90x the work
        (1, _hops(("QmB", 1, 2), ("QmC", 2, 3), ("QmB", 3, 4)), "twice"),
        (2, _hops(("QmSelf", 2, 4)), "twice"),
        (2, _hops(("QmB", 3, 4)), "contiguous"),  # a gap
        (2, _hops(("QmB", 1, 4)), "contiguous"),  # layers computed twice
        (2, _hops(("QmB", 2, 7)), "within the model"),
        (1, _hops(*((f"Qm{i}", i, i + 1) for i in range(1, 7))), "hops for a model of 6"),
    ],
    ids=["abab", "aba-other", "self-again", "gap", "overlap", "past-model", "too-many-hops"],
)
def test_a_route_that_multiplies_work_is_refused_before_any_compute(
    end: int, route: tuple[Hop, ...], match: str
) -> None:
    h = _handlers(Clock())
    request = replace(_step(h, "s", 0, 4, end=end), route_rest=route)

    async def body() -> None:
        with pytest.raises(ProtocolError, match=match):
            await h.rpc_step(request, "QmClient")
        assert h.peer.session_count == 0 and h.peer.executor.steps_run == 0

    _run(h, body)


def test_honest_routes_pass_the_check() -> None:
    peer = _handlers(Clock()).peer
    peer.check_route(LayerRange(0, 2), _hops(("QmB", 2, 4), ("QmC", 4, 6)))
    peer.check_route(LayerRange(0, 2), _hops(("QmB", 2, 3)))  # a route may end early (a middle hop's view)
    peer.check_route(LayerRange(4, 6), ())


def test_a_probe_sends_back_at_most_its_configured_bytes() -> None:
    h = _handlers(Clock())
    limit = h.config.max_probe_reply_bytes
    assert limit <= 4 * 1024**2
    assert len(asyncio.run(h.rpc_probe(ProbeRequest(reply_bytes=limit), "QmClient")).payload) == limit
    with pytest.raises(ProtocolError, match="bytes back"):
        asyncio.run(h.rpc_probe(ProbeRequest(reply_bytes=MAX_PROBE_BYTES), "QmClient"))


def test_dial_back_is_only_to_the_caller_and_never_echoes_the_dial_error() -> None:
    h = _handlers(Clock())  # no P2P: every dial fails
    with pytest.raises(ProtocolError, match="only to the peer that asks"):
        asyncio.run(h.rpc_probe(ProbeRequest(dial_back_peer_id="QmVictim"), "QmClient"))
    ask = ProbeRequest(dial_back_peer_id="QmClient", dial_back_maddrs=("/ip4/127.0.0.1/tcp/22",))
    reply = asyncio.run(h.rpc_probe(ask, "QmClient"))
    assert reply.dial_back_ok is False and reply.dial_back_error == DIAL_BACK_FAILED
