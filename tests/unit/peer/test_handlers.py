"""rpc_* handlers and the Peer that owns their state, on a real tiny BlockRange (no network: steps without a
route never call another peer). Time is an injected clock; waits are on events, never on sleeps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.models.loading import resolve_model
from swarm.peer import handlers as handlers_module
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.state import Identity, Peer, Status
from swarm.wire import (
    CloseRequest,
    ErrorReply,
    Hop,
    InfoReply,
    InfoRequest,
    ProbeRequest,
    StepAck,
    StepBatch,
    StepRequest,
    StepWait,
    StepWaits,
    decode_reply,
    encode_reply,
)

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _handlers(clock: Clock, idle_timeout_s: float = 60.0, cache_tokens: int = 64) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity("QmSelf", "unit", ("/ip4/127.0.0.1/tcp/1/p2p/QmSelf",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig(idle_timeout_s=idle_timeout_s), clock=clock)
    peer.serve(source.load_blocks(0, 2, cache_tokens=cache_tokens))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


def _step(
    h: PeerHandlers, sid: str, position: int, tokens: int, max_length: int = 32, end: int = 2
) -> StepRequest:
    hidden = torch.randn(tokens, h.peer.spec.hidden_size)
    return StepRequest(sid, position, hidden, 0, end, max_length, h.peer.spec.weights_hash)


def _run(h: PeerHandlers, body: Callable[[], Awaitable[None]]) -> None:
    run_peers([h.peer], body)


def run_peers(peers: Sequence[Peer], body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` on a fresh event loop while the executors of ``peers`` serve."""

    async def main() -> None:
        tasks = [asyncio.create_task(peer.executor.run()) for peer in peers]
        try:
            await body()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_sessions_open_implicitly_count_against_the_budget_and_expire_when_idle() -> None:
    clock = Clock()
    h = _handlers(clock, idle_timeout_s=30.0)

    async def body() -> None:
        reply = await h.rpc_step(_step(h, "s1", 0, 4), "QmClient")
        assert reply.hidden.shape == (4, h.peer.spec.hidden_size) and reply.timings[0].peer_id == "QmSelf"
        clock.now += 20
        await h.rpc_step(_step(h, "s1", 4, 1), "QmClient")  # a step resets the idle clock
        info = await h.rpc_info(InfoRequest(), "QmClient")
        # 5 tokens hold one block of 16: the session's max_length (32) is a bound, not a reservation
        assert (info.active_sessions, info.free_cache_tokens, info.cache_tokens_total) == (1, 48, 64)
        with pytest.raises(CapacityError, match="this peer has 64"):
            await h.rpc_step(_step(h, "s2", 0, 1, max_length=65), "QmClient")
        with pytest.raises(SessionError, match="unknown session"):
            await h.rpc_step(_step(h, "never-opened", 3, 1), "QmClient")
        clock.now += 29
        assert await h.peer.reap() == 0, "29 s after its last step the session is not idle yet"
        clock.now += 2
        assert await h.peer.reap() == 1
        assert h.peer.session_count == 0 and h.peer.free_cache_tokens == 64
        with pytest.raises(SessionError):
            await h.rpc_step(_step(h, "s1", 5, 1), "QmClient")
        assert (await h.rpc_close(CloseRequest("s1"), "QmClient")).closed is False

    _run(h, body)


def test_draining_refuses_new_sessions_and_waits_for_open_ones() -> None:
    h = _handlers(Clock())

    async def body() -> None:
        await h.rpc_step(_step(h, "open", 0, 2), "QmClient")
        drain = asyncio.create_task(h.peer.drain(grace_s=60.0))
        await asyncio.sleep(0)  # drain starts: the peer stops accepting
        assert h.peer.status is Status.DRAINING and h.peer.record().state == "leaving"
        with pytest.raises(CapacityError, match="leaving"):
            await h.rpc_step(_step(h, "new", 0, 1), "QmClient")
        await h.rpc_step(_step(h, "open", 2, 1), "QmClient")  # an open session may still finish
        assert not drain.done()
        await h.rpc_close(CloseRequest("open"), "QmClient")  # its end is what lets the drain finish
        await asyncio.wait_for(drain, 10)
        assert h.peer.status is Status.LEAVING and h.peer.free_cache_tokens == 64

    _run(h, body)


def test_draining_with_no_grace_closes_open_sessions() -> None:
    h = _handlers(Clock())

    async def body() -> None:
        await h.rpc_step(_step(h, "open", 0, 2), "QmClient")
        await h.peer.drain(grace_s=0.0)
        assert h.peer.session_count == 0 and h.peer.free_cache_tokens == 64
        with pytest.raises(SessionError):
            await h.rpc_step(_step(h, "open", 2, 1), "QmClient")

    _run(h, body)


def test_two_ranges_each_keep_their_own_sessions_and_cache() -> None:
    """Make before break: after serve(new), new sessions open on the new range, old ones stay on the old."""
    h = _handlers(Clock())
    source = resolve_model("tiny")

    async def body() -> None:
        await h.rpc_step(_step(h, "old", 0, 3), "QmClient")
        old = h.peer.current
        assert old is not None
        new = h.peer.serve(source.load_blocks(0, 4, cache_tokens=64))
        await h.rpc_step(_step(h, "fresh", 0, 2, end=4), "QmClient")
        await h.rpc_step(_step(h, "old", 3, 1), "QmClient")  # still served by the range it opened on
        assert set(old.sessions) == {"old@QmClient"} and set(new.sessions) == {"fresh@QmClient"}
        assert h.peer.held == new.range and h.peer.record().range_end == 4
        with pytest.raises(CapacityError, match="open on"):
            await h.rpc_step(_step(h, "old", 4, 1, end=4), "QmClient")  # layers its range does not have
        ended = asyncio.create_task(h.peer.wait_sessions_ended(old, timeout_s=60.0))
        await asyncio.sleep(0)
        assert not ended.done()
        await h.rpc_close(CloseRequest("old"), "QmClient")
        assert await asyncio.wait_for(ended, 10) is True
        await h.peer.drop(old)
        assert h.peer.ranges == [new] and old.blocks.free_cache_tokens == 64

    _run(h, body)


def test_a_wrong_hidden_size_is_a_protocol_error_and_opens_nothing() -> None:
    h = _handlers(Clock())
    bad = StepRequest("s", 0, torch.randn(2, 3), 0, 2, 32, h.peer.spec.weights_hash)

    async def body() -> None:
        with pytest.raises(ProtocolError, match="hidden size"):
            await h.rpc_step(bad, "QmClient")
        assert h.peer.session_count == 0

    _run(h, body)


def test_probe_echoes_sizes() -> None:
    h = _handlers(Clock())
    reply = asyncio.run(h.rpc_probe(ProbeRequest(payload=b"x" * 1000, reply_bytes=10), "QmClient"))
    assert (reply.peer_id, reply.received_bytes, reply.payload, reply.dial_back_ok) == (
        "QmSelf",
        1000,
        bytes(10),
        None,
    )


def test_one_remote_peer_cannot_have_more_steps_in_flight_than_its_share() -> None:
    h = _handlers(Clock(), cache_tokens=1024)
    h.config = SessionConfig(max_requests_per_remote=2)

    async def body() -> None:
        await h.rpc_step(_step(h, "a", 0, 2, max_length=4), "QmGreedy")
        # Two steps of QmGreedy queued on the executor (not yet run) hold its whole share...
        held = [
            asyncio.create_task(h.rpc_step(_step(h, sid, 0, 1, max_length=4), "QmGreedy"))
            for sid in ("b", "c")
        ]
        await asyncio.sleep(0)
        with pytest.raises(CapacityError, match="in flight"):
            await h.rpc_step(_step(h, "d", 0, 1, max_length=4), "QmGreedy")
        await h.rpc_step(_step(h, "e", 0, 1, max_length=4), "QmOther")  # ...but not anyone else's
        await asyncio.gather(*held)
        assert h.in_flight == {}
        await h.rpc_step(
            _step(h, "d", 0, 1, max_length=4), "QmGreedy"
        )  # the share comes back once they finish

    _run(h, body)


def test_a_step_whose_deadline_passes_while_queued_is_dropped_with_a_capacity_error() -> None:
    h = _handlers(Clock())

    async def body() -> None:  # no executor running: the step can only wait in the queue
        request = _step(h, "late", 0, 2)
        late = StepRequest(**{**vars(request), "timeout_s": 0.05})
        with pytest.raises(CapacityError, match="deadline"):
            await h.rpc_step(late, "QmClient")
        assert h.in_flight == {}

    asyncio.run(body())


def test_a_middle_hop_sends_decode_steps_on_one_route_on_together_each_with_its_own_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps with a hop after the next one (this peer is a middle hop) that came in one message go on to the
    next hop together, and a failure there fails only its own step, naming the hop that failed."""
    h = _handlers(Clock(), cache_tokens=1024)
    hop = Hop("QmNext", ("/ip4/127.0.0.1/tcp/1/p2p/QmNext",), 2, 4)
    after = Hop("QmAfter", ("/ip4/127.0.0.1/tcp/1/p2p/QmAfter",), 4, 6)
    sent: list[list[str]] = []

    async def next_hop(p2p: object, peer_id: str, requests: list[StepRequest], **_: object) -> list[object]:
        assert peer_id == "QmNext" and all(r.route_rest == (after,) and r.start == 2 for r in requests)
        sent.append([r.session_id for r in requests])
        refused = CapacityError("no room for s1")
        refused.failed_peer_id = "QmNext"
        return [refused if (r.session_id, r.position) == ("s1", 1) else StepAck() for r in requests]

    async def next_hop_one(p2p: object, peer_id: str, request: StepRequest, **_: object) -> object:
        outcome = (await next_hop(p2p, peer_id, [request]))[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(handlers_module, "call_step_batch", next_hop)
    monkeypatch.setattr(handlers_module, "call_step_acked", next_hop_one)

    def onward(sid: str, position: int) -> StepRequest:
        step = _step(h, sid, position, 1, max_length=8)
        return replace(step, route_rest=(hop, after), wait_result=True, origin="QmClient")

    async def body() -> None:
        for i in range(
            4
        ):  # the sessions' first steps, one by one (opening a session takes its own turn here)
            await h.rpc_step(onward(f"s{i}", 0), "QmPrevious")
        sent.clear()
        reply = await h.rpc_steps(StepBatch(tuple(onward(f"s{i}", 1) for i in range(4))), "QmPrevious")
        kinds = [type(o).__name__ for o in reply.outcomes]
        assert kinds == ["StepAck", "ErrorReply", "StepAck", "StepAck"]
        refused = reply.outcomes[1]
        assert isinstance(refused, ErrorReply) and refused.failed_peer_id == "QmNext"
        assert sorted(sid for message in sent for sid in message) == ["s0", "s1", "s2", "s3"]
        assert len(sent) < 4, "steps computed together here go on together"

    run_peers([h.peer], body)


def test_forwarded_steps_each_run_as_their_own_step_and_fail_alone() -> None:
    h = _handlers(Clock(), cache_tokens=1024)
    alone = _handlers(Clock(), cache_tokens=1024)  # the same steps sent one by one, for the expected outputs

    def forwarded(sid: str, hidden: torch.Tensor) -> StepRequest:
        return replace(_step(h, sid, 0, 1, max_length=8), hidden=hidden, wait_result=True, origin="QmClient")

    async def body() -> None:
        hiddens = [torch.randn(1, h.peer.spec.hidden_size) for _ in range(3)]
        steps = [forwarded(f"s{i}", hidden) for i, hidden in enumerate(hiddens)]
        steps.insert(1, replace(steps[0], session_id="bad", hidden=torch.randn(1, 3)))  # wrong hidden size
        steps.insert(
            3, replace(steps[0], session_id="relayed", wait_result=False)
        )  # answered with its output
        reply = await h.rpc_steps(StepBatch(tuple(steps)), "QmPrevious")
        kinds = [type(o).__name__ for o in reply.outcomes]
        assert kinds == ["StepAck", "ErrorReply", "StepAck", "StepReply", "StepAck"]
        assert [o.code for o in reply.outcomes if isinstance(o, ErrorReply)] == ["protocol"]
        for i, hidden in enumerate(hiddens):
            out = await h.rpc_wait(StepWait(f"s{i}", 0, 10.0), "QmClient")
            expected = await alone.rpc_step(
                replace(_step(alone, f"s{i}", 0, 1, max_length=8), hidden=hidden), "QmClient"
            )
            assert torch.allclose(out.hidden, expected.hidden, atol=1e-5)
        relayed = await alone.rpc_step(
            replace(_step(alone, "relayed", 0, 1, max_length=8), hidden=hiddens[0]), "QmClient"
        )
        assert torch.allclose(reply.outcomes[3].hidden, relayed.hidden, atol=1e-5)  # type: ignore[union-attr]
        assert h.peer.session_count == 4, "the refused step opened no session"

    run_peers([h.peer, alone.peer], body)


def test_a_clients_waits_in_one_message_each_get_their_own_output_or_error() -> None:
    h = _handlers(Clock(), cache_tokens=1024)
    alone = _handlers(
        Clock(), cache_tokens=1024
    )  # the same steps with their outputs answered directly, for the expected outputs

    def sent(handlers: PeerHandlers, sid: str, hidden: torch.Tensor, wait_result: bool) -> StepRequest:
        return replace(_step(handlers, sid, 0, 1, max_length=8), hidden=hidden, wait_result=wait_result)

    async def body() -> None:
        hiddens = {f"s{i}": torch.randn(1, h.peer.spec.hidden_size) for i in range(3)}
        for sid, hidden in hiddens.items():
            assert isinstance(await h.rpc_step(sent(h, sid, hidden, True), "QmClient"), StepAck)
        order = ["s2", "ghost", "s0", "s1"]  # a wait for a step that never came fails at its deadline, alone
        waits = tuple(StepWait(sid, 0, 10.0 if sid != "ghost" else 0.01) for sid in order)
        reply = await h.rpc_waits(StepWaits(waits), "QmClient")
        assert [type(o).__name__ for o in reply.outcomes] == [
            "StepReply",
            "ErrorReply",
            "StepReply",
            "StepReply",
        ]
        assert isinstance(reply.outcomes[1], ErrorReply) and reply.outcomes[1].code == "capacity"
        for sid, outcome in zip(order, reply.outcomes, strict=True):
            if sid == "ghost":
                continue
            expected = await alone.rpc_step(sent(alone, sid, hiddens[sid], False), "QmClient")
            assert torch.allclose(outcome.hidden, expected.hidden, atol=1e-5)  # type: ignore[union-attr]

    run_peers([h.peer, alone.peer], body)


def test_a_close_that_overtakes_the_first_step_keeps_the_session_closed() -> None:
    """A client that went away closes its session before its first step got here: that step, when it comes,
    opens nothing (the session would hold cache until its idle timeout); other sessions open as ever, and after
    closed_memory_s the id is free again."""
    clock = Clock()
    h = _handlers(clock)

    async def body() -> None:
        assert (await h.rpc_close(CloseRequest("gone"), "QmClient")).closed is False
        with pytest.raises(SessionError, match="closed by its client"):
            await h.rpc_step(_step(h, "gone", 0, 4), "QmClient")
        assert h.peer.session_count == 0
        await h.rpc_step(_step(h, "other", 0, 4), "QmClient")
        clock.now += SessionConfig().closed_memory_s + 1
        await h.rpc_close(CloseRequest("other"), "QmClient")  # an open session's close: remembered too
        await h.rpc_step(_step(h, "gone", 0, 4), "QmClient")
        assert h.peer.session_count == 1

    _run(h, body)


def test_a_step_running_when_its_session_is_closed_does_not_go_on_to_the_next_hop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The close goes down the route at once; the step running here meanwhile must not follow it and open the
    session again at the next hop."""
    h = _handlers(Clock())
    served = h.peer.current
    assert served is not None
    running, go = threading.Event(), threading.Event()
    real_forward = served.blocks.forward
    forwarded: list[StepRequest] = []

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        running.set()
        go.wait(30)
        return real_forward(*args, **kwargs)

    async def next_hop(p2p: object, peer_id: str, request: StepRequest, **_: object) -> object:
        forwarded.append(request)
        raise AssertionError("a step of a closed session went on")

    monkeypatch.setattr(handlers_module, "call_step_acked", next_hop)
    monkeypatch.setattr(handlers_module, "call_step", next_hop)
    hop = Hop("QmNext", ("/ip4/127.0.0.1/tcp/1/p2p/QmNext",), 2, 4)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        await h.rpc_step(_step(h, "s", 0, 4), "QmClient")  # opened here (no next hop)
        served.blocks.forward = slow_forward  # type: ignore[method-assign]
        step = asyncio.create_task(h.rpc_step(replace(_step(h, "s", 4, 1), route_rest=(hop,)), "QmClient"))
        assert await loop.run_in_executor(None, running.wait, 30)
        closing = asyncio.create_task(h.rpc_close(CloseRequest("s"), "QmClient"))
        await asyncio.sleep(0)  # the close starts: it is remembered before it awaits anything
        go.set()
        with pytest.raises(SessionError, match="closed by its client while this step ran"):
            await step
        assert (await closing).closed is True and forwarded == [] and h.peer.session_count == 0

    _run(h, body)


def test_with_prefix_sharing_a_peer_answers_as_without_it() -> None:
    """--session-share-prefixes: a prompt sent after another with the same first 32 tokens, whole or in chunks,
    gets the same outputs as from a peer that computes everything (sharing the full blocks it can: a step
    computes at least its last token)."""
    source = resolve_model("tiny")
    peers = []
    for share in (True, False):
        config = SessionConfig(share_prefixes=share)
        identity = Identity("QmSelf", "unit", (), 1 << 30, 6)
        peer = Peer(identity, source.spec, Executor(), config, clock=Clock())
        peer.serve(source.load_blocks(0, 2, cache_tokens=256))
        peers.append(PeerHandlers(peer, p2p=None, config=config))  # type: ignore[arg-type]
    rows = torch.randn(40, source.spec.hidden_size, generator=torch.Generator().manual_seed(7))
    other = torch.randn(8, source.spec.hidden_size, generator=torch.Generator().manual_seed(8))

    def step(sid: str, position: int, hidden: torch.Tensor) -> StepRequest:
        return StepRequest(sid, position, hidden, 0, 2, 64, source.spec.weights_hash)

    async def body() -> None:
        prompts = {"x": rows, "y": torch.cat([rows[:32], other]), "z": torch.cat([rows[:32], other])}
        for h in peers:
            replies = [await h.rpc_step(step("x", 0, prompts["x"]), "QmClient")]
            replies.append(await h.rpc_step(step("y", 0, prompts["y"]), "QmClient"))
            for position, end in ((0, 24), (24, 40)):  # z in chunks: its first shares a block
                replies.append(await h.rpc_step(step("z", position, prompts["z"][position:end]), "QmC"))
            h.outputs = torch.cat([r.hidden for r in replies])  # type: ignore[attr-defined]
        sharing, plain = peers
        torch.testing.assert_close(sharing.outputs, plain.outputs, atol=1e-5, rtol=1e-5)  # type: ignore[attr-defined]
        cache = sharing.peer.current.blocks.cache  # type: ignore[union-attr]
        assert cache.prefix_tokens_shared == 32 + 16  # y's two blocks, and one in z's first chunk
        # rpc_info reports the blocks and the hit rate, as a remote reads them off the wire
        info = decode_reply(encode_reply(await sharing.rpc_info(InfoRequest(), "QmC")))
        assert isinstance(info, InfoReply) and info.cache is not None
        stats = info.cache
        assert (stats.prefix_tokens_shared, stats.prefix_tokens_looked_up) == (
            48,
            40 + 40 + 24,
        )  # z: 1st chunk
        assert stats.shared_blocks == 2 and stats.used_blocks == 3 + 1 + 2  # x's 3, y's 3rd, z's 2nd and 3rd
        assert stats.used_blocks + stats.free_blocks == 256 // stats.block_tokens
        plain_info = await plain.rpc_info(InfoRequest(), "QmC")
        assert plain_info.cache is not None and plain_info.cache.prefix_hit_rate == 0.0

    run_peers([h.peer for h in peers], body)
