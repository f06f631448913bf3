"""Hostile requests at a peer's RPC boundary, on a real tiny Peer (no network: nothing here reaches a next hop).

Routes that multiply work, probes used as port scanners or traffic amplifiers, sessions stepped or closed by
someone else, one remote squatting the KV cache, reservations leaked by cancelled opens.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch

from swarm.errors import CapacityError, ProtocolError, SessionError, SessionEvicted
from swarm.models.loading import resolve_model
from swarm.peer import handlers as handlers_module
from swarm.peer.config import ExecutorConfig, SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import DIAL_BACK_FAILED, PeerHandlers
from swarm.peer.state import Identity, Peer, session_key
from swarm.types import LayerRange
from swarm.wire import MAX_PROBE_BYTES, CloseRequest, Hop, ProbeRequest
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


def test_a_hop_that_is_not_a_live_peer_is_refused_before_any_compute() -> None:
    """A route naming a peer missing from this peer's read of the DHT: CapacityError naming that hop (the read
    may be a few seconds stale, so the client routes around the hop for the session and bans nobody)."""
    h = _handlers(Clock())
    h.peer.set_live_peers({"QmSelf", "QmB"})
    request = replace(_step(h, "s", 0, 4), route_rest=_hops(("QmB", 2, 4), ("QmGhost", 4, 6)))

    async def body() -> None:
        with pytest.raises(CapacityError, match="not a live peer") as refused:
            await h.rpc_step(request, "QmClient")
        assert refused.value.failed_peer_id == "QmGhost"
        assert h.peer.session_count == 0 and h.peer.executor.steps_run == 0

    _run(h, body)


def test_live_hops_are_checked_only_once_a_complete_read_came_in() -> None:
    peer = _handlers(Clock()).peer
    route = _hops(("QmB", 2, 4))

    async def body() -> None:
        await peer.check_live(route)  # just started: no read yet, nothing to check against
        peer.set_live_peers({"QmB", "QmC"})  # a read without ourselves is incomplete: ignored
        assert peer.live_peers is None
        peer.set_live_peers({"QmSelf", "QmC"})
        with pytest.raises(CapacityError, match="hop 1"):
            await peer.check_live(route)
        peer.set_live_peers({"QmSelf", "QmB"})  # it joined: the next read lets it through
        await peer.check_live(route)

    asyncio.run(body())


def test_a_hop_newer_than_our_read_is_let_through_after_one_re_read_and_strangers_get_one_per_second() -> (
    None
):
    clock = Clock()
    dht = {"QmSelf", "QmC"}
    reads = []

    async def read_live() -> set[str]:
        reads.append(clock.now)
        return set(dht)

    h = _handlers(clock)
    peer = Peer(h.peer.identity, h.peer.spec, h.peer.executor, clock=clock, read_live=read_live)
    peer.set_live_peers({"QmSelf"})

    async def body() -> None:
        await peer.check_live(_hops(("QmC", 2, 4)))  # joined after our last read: re-read, found
        with pytest.raises(CapacityError, match="not a live peer"):
            await peer.check_live(_hops(("QmGhost", 2, 4)))  # within the second: refused without a read
        assert reads == [clock.now]
        clock.now += 1.0
        dht.add("QmD")
        # two at once share one re-read
        await asyncio.gather(peer.check_live(_hops(("QmD", 2, 4))), peer.check_live(_hops(("QmD", 2, 4))))
        assert len(reads) == 2

    asyncio.run(body())


def test_probes_count_against_the_callers_share_of_requests() -> None:
    h = _handlers(Clock())
    h.in_flight["QmClient"] = h.config.max_requests_per_remote
    with pytest.raises(CapacityError, match="in flight"):
        asyncio.run(h.rpc_probe(ProbeRequest(reply_bytes=1024), "QmClient"))
    assert len(asyncio.run(h.rpc_probe(ProbeRequest(reply_bytes=1024), "QmOther")).payload) == 1024


def test_a_probe_sends_back_at_most_its_configured_bytes() -> None:
    h = _handlers(Clock())
    limit = h.config.max_probe_reply_bytes
    assert limit <= 256 * 1024  # the largest link probe: a probe is no traffic amplifier
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


def _peer(
    clock: Clock, sessions: SessionConfig, queue_jobs: int = 256, cache_tokens: int = 64
) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity("QmSelf", "unit", (), 1 << 30, 6)
    executor = Executor(ExecutorConfig(queue_jobs=queue_jobs))
    peer = Peer(identity, source.spec, executor, sessions, clock=clock)
    peer.serve(source.load_blocks(0, 2, cache_tokens=cache_tokens))
    return PeerHandlers(peer, p2p=None, config=sessions)  # type: ignore[arg-type]


def _length(h: PeerHandlers, remote: str, sid: str) -> int:
    current = h.peer.current
    assert current is not None
    return current.blocks.session_length(session_key(remote, sid), 0)


def test_only_the_remote_that_opened_a_session_can_step_rewind_or_close_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = _handlers(Clock())
    forwarded: list[str] = []

    async def fake_close(p2p: object, peer_id: str, request: CloseRequest, **kwargs: object) -> bool:
        forwarded.append(peer_id)
        return True

    monkeypatch.setattr(handlers_module, "call_close", fake_close)

    async def body() -> None:
        await h.rpc_step(_step(h, "s", 0, 4), "QmAlice")
        with pytest.raises(SessionError, match="unknown session"):
            await h.rpc_step(_step(h, "s", 4, 1), "QmMallory")
        await h.rpc_step(_step(h, "s", 0, 2), "QmMallory")  # position 0: a session of Mallory's own
        assert _length(h, "QmAlice", "s") == 4 and _length(h, "QmMallory", "s") == 2
        hop = Hop("QmNext", (), 2, 4)
        assert (await h.rpc_close(CloseRequest("s", (hop,)), "QmEve")).closed is False
        assert forwarded == [], "a stranger's close must not be passed down the route in our name"
        await h.rpc_step(_step(h, "s", 4, 1), "QmAlice")  # Alice's session is untouched
        assert _length(h, "QmAlice", "s") == 5
        assert (await h.rpc_close(CloseRequest("s", (hop,)), "QmAlice")).closed is True
        assert forwarded == ["QmNext"] and h.peer.session_count == 1  # Mallory's own is still open

    _run(h, body)


def test_a_session_is_its_clients_so_it_survives_a_new_hop_before_us_but_not_a_wrong_origin() -> None:
    """After a failover upstream, a new previous hop continues the session (our cache is kept); a step or close
    naming another origin, or none, reaches another session."""
    h = _handlers(Clock())

    async def body() -> None:
        await h.rpc_step(replace(_step(h, "s", 0, 4), origin="QmAlice"), "QmHopA")
        await h.rpc_step(replace(_step(h, "s", 4, 1), origin="QmAlice"), "QmHopB")  # HopA was replaced
        assert _length(h, "QmAlice", "s") == 5
        with pytest.raises(SessionError, match="unknown session"):
            await h.rpc_step(_step(h, "s", 5, 1), "QmHopB")  # no origin: HopB's own session "s"
        with pytest.raises(SessionError, match="unknown session"):
            await h.rpc_step(replace(_step(h, "s", 5, 1), origin="QmBob"), "QmHopB")
        assert (await h.rpc_close(CloseRequest("s", (), origin="QmBob"), "QmHopB")).closed is False
        assert (await h.rpc_close(CloseRequest("s", (), origin="QmAlice"), "QmHopB")).closed is True
        assert h.peer.session_count == 0

    _run(h, body)


def test_one_remote_cannot_squat_the_cache_or_the_session_table() -> None:
    h = _peer(Clock(), SessionConfig(max_sessions_per_remote=2, max_remote_cache_fraction=0.5))

    async def body() -> None:
        await h.rpc_step(_step(h, "big", 0, 20, max_length=64), "QmSquatter")  # 2 blocks: its whole share
        with pytest.raises(CapacityError, match="one peer may hold"):
            await h.rpc_step(_step(h, "more", 0, 1, max_length=1), "QmSquatter")
        await h.rpc_step(_step(h, "honest", 0, 20, max_length=64), "QmHonest")  # the other half is free
        await h.rpc_close(CloseRequest("honest"), "QmHonest")
        await h.rpc_step(_step(h, "a", 0, 1, max_length=1), "QmMany")
        await h.rpc_step(_step(h, "b", 0, 1, max_length=1), "QmMany")
        with pytest.raises(CapacityError, match="sessions open here"):
            await h.rpc_step(_step(h, "c", 0, 1, max_length=1), "QmMany")

    _run(h, body)


def test_fresh_identities_holding_one_token_sessions_cannot_keep_an_honest_client_out() -> None:
    """Sybils: 16 fresh identities fill the whole cache with one-token sessions of the largest size they may
    ask for, and keep them alive with a step every 30 s. An honest client opening then generates 40 tokens, a
    step a second: every step is served at once (no refusal, no retry), taking its blocks from the squatters;
    a squatter whose blocks were taken is told SessionEvicted; the honest session never loses its cache."""
    clock = Clock()
    h = _peer(clock, SessionConfig(idle_timeout_s=60.0, max_remote_cache_fraction=0.5), cache_tokens=512)
    squatters = [(f"QmSybil{i:02d}", f"s{j}") for i in range(16) for j in range(2)]  # 32 blocks: all of it

    async def body() -> None:
        for remote, sid in squatters:
            await h.rpc_step(_step(h, sid, 0, 1, max_length=256), remote)
        assert h.peer.current is not None and h.peer.current.blocks.cache.free_tokens == 0
        evicted: set[tuple[str, str]] = set()
        position = 0
        for second in range(1, 60):
            clock.now += 1.0
            if second % 30 == 0:  # the squatters' keep-alive
                for remote, sid in squatters:
                    if (remote, sid) not in evicted:
                        try:
                            await h.rpc_step(_step(h, sid, 1, 1, max_length=256), remote)
                        except SessionEvicted:
                            evicted.add((remote, sid))
            if position < 40:
                tokens = 9 if position == 0 else 1  # a prompt, then decode steps
                reply = await h.rpc_step(_step(h, "honest", position, tokens, max_length=256), "QmHonest")
                assert reply.hidden.shape[0] == tokens
                position += tokens
        assert position == 40 and _length(h, "QmHonest", "honest") == 40
        assert len(evicted) == 3  # 40 tokens: 3 blocks taken back from squatters, each told so at its step

    _run(h, body)


def test_a_trickle_of_tiny_steps_cannot_keep_a_session_past_its_lifetime() -> None:
    clock = Clock()
    h = _peer(clock, SessionConfig(idle_timeout_s=60.0, max_session_lifetime_s=600.0))

    async def body() -> None:
        await h.rpc_step(_step(h, "s", 0, 1), "QmSquatter")
        for position in range(1, 11):  # one token just before each idle timeout
            clock.now += 59
            assert await h.peer.reap() == 0
            await h.rpc_step(_step(h, "s", position, 1), "QmSquatter")
        clock.now += 59  # 649 s after it opened, 59 s after its last step
        assert await h.peer.reap() == 1 and h.peer.free_cache_tokens == 64

    _run(h, body)


def test_a_cancelled_open_releases_its_reservation() -> None:
    h = _handlers(Clock())
    current = h.peer.current
    assert current is not None
    blocks = current.blocks
    started, go = threading.Event(), threading.Event()
    real_open = blocks.open_session

    def slow_open(session_id: str, max_length_tokens: int) -> None:
        started.set()
        go.wait(30)
        real_open(session_id, max_length_tokens)

    blocks.open_session = slow_open  # type: ignore[method-assign]

    async def body() -> None:
        loop = asyncio.get_running_loop()
        # Cancelled while its open runs on the torch thread: the open completes, then is undone.
        running = asyncio.create_task(h.rpc_step(_step(h, "running", 0, 1), "QmClient"))
        assert await loop.run_in_executor(None, started.wait, 30)
        # Cancelled while still queued behind it: skipped.
        queued = asyncio.create_task(h.rpc_step(_step(h, "queued", 0, 1), "QmClient"))
        await asyncio.sleep(0)
        running.cancel()
        queued.cancel()
        go.set()
        await asyncio.gather(running, queued, return_exceptions=True)
        await h.peer.executor.call(lambda: None)  # runs after the open and its undo
        assert h.peer.session_count == 0 and blocks.free_cache_tokens == 64 and blocks.active_sessions == []

    _run(h, body)


def test_closing_frees_the_cache_even_when_the_queue_is_full() -> None:
    h = _peer(Clock(), SessionConfig(), queue_jobs=1)
    taken, go = threading.Event(), threading.Event()

    def block() -> None:
        taken.set()
        go.wait(30)

    async def body() -> None:
        await h.rpc_step(_step(h, "s", 0, 1), "QmClient")
        blocker = asyncio.create_task(h.peer.executor.call(block))
        assert await asyncio.get_running_loop().run_in_executor(None, taken.wait, 30)  # the thread is busy
        filler = asyncio.create_task(h.peer.executor.call(lambda: None))  # the queue is full
        await asyncio.sleep(0)
        with pytest.raises(CapacityError, match="busy"):
            await h.peer.executor.call(lambda: None)
        closing = asyncio.create_task(h.rpc_close(CloseRequest("s"), "QmClient"))
        await asyncio.sleep(0)
        go.set()
        assert (await closing).closed is True
        await asyncio.gather(blocker, filler)
        assert h.peer.free_cache_tokens == 64

    _run(h, body)
