"""Hand-over of a session's KV cache between two in-process peers on the tiny model: every chunk goes through
the real wire encoding (encode -> decode) into the receiver's rpc_handover; no network, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
import torch

from client.retry import Action, RetryPolicy
from swarm.errors import CapacityError, ModelMismatch, ProtocolError, SessionError, SessionMoved
from swarm.models.loading import resolve_model
from swarm.peer import handover as handover_module
from swarm.peer.config import SessionConfig
from swarm.peer.executor import Executor
from swarm.peer.handlers import PeerHandlers
from swarm.peer.handover import Snapshot, chunks, read_session
from swarm.peer.state import Identity, Peer, session_key
from swarm.types import LayerRange
from swarm.wire import (
    ErrorReply,
    HandoverRequest,
    MoveRequest,
    StepRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from tests.unit.peer.test_handlers import run_peers

pytestmark = pytest.mark.timeout(60)
CLIENT = "QmClient"


def _handlers(name: str, cache_tokens: int = 64) -> PeerHandlers:
    torch.set_num_threads(1)
    source = resolve_model("tiny")
    identity = Identity(name, name, (f"/ip4/127.0.0.1/tcp/1/p2p/{name}",), 1 << 30, 6)
    peer = Peer(identity, source.spec, Executor(), SessionConfig())
    peer.serve(source.load_blocks(0, 2, cache_tokens=cache_tokens))
    return PeerHandlers(peer, p2p=None)  # type: ignore[arg-type]


def _run(peers: list[PeerHandlers], body: Callable[[], Awaitable[None]]) -> None:
    run_peers([h.peer for h in peers], body)


def _step(h: PeerHandlers, position: int, hidden: torch.Tensor, sid: str = "s1") -> StepRequest:
    return StepRequest(sid, position, hidden, 0, 2, 32, h.peer.spec.weights_hash)


def _wired(receiver: PeerHandlers, sent: list[int]) -> Callable[..., Awaitable[bool]]:
    """call_handover through the real wire bytes into ``receiver``, as the transport would."""

    async def call(p2p: object, peer_id: str, request: HandoverRequest, **_: object) -> bool:
        assert peer_id == receiver.peer_id
        data = encode_request(request)
        sent.append(len(data))
        decoded = decode_request(data)
        assert isinstance(decoded, HandoverRequest)
        return (await receiver.rpc_handover(decoded, "QmSender")).installed

    return call


def test_handed_over_cache_gives_the_same_output_and_the_sender_answers_session_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = _handlers("QmA"), _handlers("QmB")
    sent: list[int] = []
    monkeypatch.setattr(handover_module, "call_handover", _wired(b, sent))
    monkeypatch.setattr(handover_module, "CHUNK_BYTES", 256)  # many chunks, even for a few tokens
    torch.manual_seed(0)
    prompt, nxt = torch.randn(5, a.peer.spec.hidden_size), torch.randn(1, a.peer.spec.hidden_size)

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        expected = (await a.rpc_step(_step(a, 5, nxt), CLIENT)).hidden  # type: ignore[union-attr]
        key = session_key(CLIENT, "s1")
        served = a.peer.find(key)
        assert served is not None
        moved = await a.handover.hand_over_all([served], {"QmB": b.peer.record()})
        assert moved == 1 and len(sent) > 2
        assert a.peer.session_count == 0, "the sender freed the moved session"
        # the successor holds the 6 tokens under the same key; a step at 5 (a retry) recomputes the same
        got = (await b.rpc_step(_step(b, 5, nxt), CLIENT)).hidden  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected)
        with pytest.raises(SessionMoved) as caught:
            await a.rpc_step(_step(a, 6, nxt), CLIENT)
        assert caught.value.successor_id == "QmB"
        # the error keeps its type and successor over the wire, and old clients see a SessionError
        reply = decode_reply(encode_reply(ErrorReply.from_error(caught.value, "QmA")))
        error = reply.to_error()  # type: ignore[union-attr]
        assert isinstance(error, SessionMoved) and isinstance(error, SessionError)
        assert (error.successor_id, error.failed_peer_id) == ("QmB", "QmA")

    _run([a, b], body)


def test_no_successor_leaves_the_session_where_it_is() -> None:
    a = _handlers("QmA")
    prompt = torch.randn(3, a.peer.spec.hidden_size)

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        served = a.peer.current
        assert served is not None
        full = a.peer.record().model_copy(
            update={"peer_id": "QmFull", "free_cache_tokens": 8}
        )  # 32 asked: no room
        assert await a.handover.hand_over_all([served], {"QmFull": full, "QmA": a.peer.record()}) == 0
        await a.rpc_step(_step(a, 3, prompt[:1]), CLIENT)  # still served here, unfrozen

    _run([a], body)


def _snapshot_chunks(h: PeerHandlers, tokens: int, sid: str = "s1") -> list[HandoverRequest]:
    blocks = h.peer.current.blocks  # type: ignore[union-attr]
    snapshot = read_session(blocks, session_key(CLIENT, sid))
    assert isinstance(snapshot, Snapshot) and snapshot.position == tokens
    return chunks(snapshot, sid, CLIENT, h.peer.spec.weights_hash)


def test_hostile_hand_over_chunks_get_clear_errors_and_the_receiver_keeps_serving() -> None:
    a, b = _handlers("QmA"), _handlers("QmB")
    prompt = torch.randn(4, a.peer.spec.hidden_size)

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        good = _snapshot_chunks(a, 4)
        first, second = good[0], good[1]
        with pytest.raises(SessionError, match="no hand-over"):
            await b.rpc_handover(second, "QmEvil")  # not its first chunk: nothing under way
        bad = replace(first, keys=first.keys[:1], values=first.values[:1])
        with pytest.raises(ProtocolError, match="shaped"):
            await b.rpc_handover(bad, "QmEvil")
        assert b.peer.session_count == 0, "a refused hand-over frees what it reserved"
        with pytest.raises(CapacityError):
            await b.rpc_handover(replace(first, max_length_tokens=65), "QmEvil")  # over the whole cache
        assert not (await b.rpc_handover(first, "QmEvil")).installed
        with pytest.raises(ProtocolError, match="expected layer"):
            await b.rpc_handover(replace(second, token_start=1), "QmEvil")  # out of order
        assert b.peer.session_count == 0
        with pytest.raises(ModelMismatch):
            await b.rpc_handover(replace(first, model_hash="0" * 64), "QmEvil")
        other = torch.randn(2, b.peer.spec.hidden_size)
        await b.rpc_step(StepRequest("s2", 0, other, 0, 2, 8, b.peer.spec.weights_hash), CLIENT)

    _run([a, b], body)


def test_a_hand_over_counts_against_the_senders_share() -> None:
    a = _handlers("QmA", cache_tokens=128)
    b = _handlers("QmB", cache_tokens=64)  # one remote may hold half of it by default: 2 blocks
    prompt = torch.randn(20, a.peer.spec.hidden_size)  # 2 blocks

    async def body() -> None:
        for sid in ("s1", "s2"):
            await a.rpc_step(_step(a, 0, prompt, sid), CLIENT)
        for request in _snapshot_chunks(a, 20, "s1"):
            last = await b.rpc_handover(request, "QmSender")
        assert last.installed
        with pytest.raises(CapacityError, match="QmSender"[-8:]):
            await b.rpc_handover(_snapshot_chunks(a, 20, "s2")[0], "QmSender")

    _run([a, b], body)


def test_wire_refuses_a_chunk_past_the_sessions_position() -> None:
    keys = torch.zeros(1, 3, 4)
    request = HandoverRequest("s", CLIENT, 2, 8, 0, 2, "h", 0, 0, keys, keys)
    with pytest.raises(ProtocolError, match="past position"):
        decode_request(encode_request(request))


def test_retry_follows_session_moved_only_with_a_successor() -> None:
    policy = RetryPolicy(max_retries=3, retry_delay_s=0.0)
    moved = SessionMoved("moved", "QmB")
    moved.failed_peer_id = "QmA"
    decision = policy.decide(moved, 0)
    assert (decision.action, decision.successor, decision.failed_peer) == (Action.FOLLOW, "QmB", "QmA")
    assert policy.decide(SessionMoved("moved"), 0).action is Action.REPLAY
    assert policy.decide(moved, 3).action is Action.GIVE_UP
    assert LayerRange(0, 2).covers(LayerRange(0, 2))


def test_a_step_during_the_hand_over_waits_for_it_then_gets_session_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = _handlers("QmA"), _handlers("QmB")
    sent: list[int] = []
    wired = _wired(b, sent)
    first_chunk_in, release = asyncio.Event(), asyncio.Event()

    async def slow(*args: object, **kwargs: object) -> bool:
        first_chunk_in.set()
        await release.wait()  # the transfer is under way while the client's next step arrives
        return await wired(*args, **kwargs)

    monkeypatch.setattr(handover_module, "call_handover", slow)
    prompt = torch.randn(3, a.peer.spec.hidden_size)

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        served = a.peer.current
        assert served is not None
        moving = asyncio.create_task(a.handover.hand_over_all([served], {"QmB": b.peer.record()}))
        await first_chunk_in.wait()
        step = asyncio.create_task(a.rpc_step(_step(a, 3, prompt[:1]), CLIENT))
        for _ in range(20):  # let the step reach its wait (it must not compute on the frozen cache)
            await asyncio.sleep(0)
        assert not step.done()
        release.set()
        assert await moving == 1
        with pytest.raises(SessionMoved):
            await step
        # the successor got the 3 tokens, not a 4th computed during the transfer
        assert b.peer.current.blocks.session_length(session_key(CLIENT, "s1"), 0) == 3  # type: ignore[union-attr]

    _run([a, b], body)


def test_a_client_moves_its_session_to_a_peer_it_names_one_token_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rpc_move: the named target gets a one-token chunk first (it opens the session, or refuses, before the
    bulk), then the rest; the output there is the one the sender would have given. A refusing target and a
    caller that is not the session's client leave the session where it is, serving."""
    a, b, small = _handlers("QmA"), _handlers("QmB"), _handlers("QmSmall", cache_tokens=16)
    sent: list[HandoverRequest] = []
    receivers = {h.peer_id: h for h in (b, small)}

    async def call(p2p: object, peer_id: str, request: HandoverRequest, **_: object) -> bool:
        decoded = decode_request(encode_request(request))
        assert isinstance(decoded, HandoverRequest)
        sent.append(decoded)
        return (await receivers[peer_id].rpc_handover(decoded, "QmA")).installed

    monkeypatch.setattr(handover_module, "call_handover", call)
    torch.manual_seed(0)
    prompt, nxt = torch.randn(6, a.peer.spec.hidden_size), torch.randn(1, a.peer.spec.hidden_size)

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        with pytest.raises(
            CapacityError, match="cache tokens"
        ):  # 32 asked, 16 held: refused at the first chunk
            await a.rpc_move(MoveRequest("s1", "QmSmall"), CLIENT)
        assert [r.keys.shape[1] for r in sent] == [1] and small.peer.session_count == 0
        with pytest.raises(SessionError, match="no session"):  # another caller's key: not found
            await a.rpc_move(MoveRequest("s1", "QmB"), "QmSomebody")
        with pytest.raises(ProtocolError, match="origin"):
            await a.rpc_move(MoveRequest("s1", "QmB", origin="QmSomebody"), CLIENT)
        expected = (await a.rpc_step(_step(a, 6, nxt), CLIENT)).hidden  # type: ignore[union-attr]
        sent.clear()
        reply = await a.rpc_move(MoveRequest("s1", "QmB"), CLIENT)
        assert reply.tokens == 7 and reply.kv_bytes > 0
        assert [(r.layer, r.token_start, r.keys.shape[1]) for r in sent] == [(0, 0, 1), (0, 1, 6), (1, 0, 7)]
        assert a.peer.session_count == 0 and b.peer.session_count == 1
        got = (await b.rpc_step(_step(b, 6, nxt), CLIENT)).hidden  # type: ignore[union-attr]
        torch.testing.assert_close(got, expected)
        with pytest.raises(SessionMoved):
            await a.rpc_move(MoveRequest("s1", "QmB"), CLIENT)

    _run([a, b, small], body)


@pytest.mark.parametrize("layers", [(0, 1), None])
def test_concurrent_moves_of_one_session_send_its_cache_once(
    monkeypatch: pytest.MonkeyPatch, layers: tuple[int, int] | None
) -> None:
    """A client asking for 8 moves of one session at once, to 8 targets that confirm anything: one is sent,
    the others are refused while it is under way."""
    a = _handlers("QmA")
    sent: dict[str, int] = {}

    async def confirming(p2p: object, peer_id: str, request: HandoverRequest, **_: object) -> bool:
        await asyncio.sleep(0)  # the send yields, as a network hop does
        sent[peer_id] = sent.get(peer_id, 0) + request.keys.shape[1]
        return True

    monkeypatch.setattr(handover_module, "call_handover", confirming)
    prompt = torch.randn(6, a.peer.spec.hidden_size, generator=torch.Generator().manual_seed(0))

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        asks = [a.rpc_move(MoveRequest("s1", f"QmT{i}", layers=layers), CLIENT) for i in range(8)]
        results = await asyncio.gather(*asks, return_exceptions=True)
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(sent) == 1 and len(refused) == 7, results
        assert all(isinstance(r, SessionError) and "handed over already" in str(r) for r in refused)

    _run([a], body)


def test_a_session_moved_in_parts_cannot_go_whole_or_send_a_layer_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = _handlers("QmA")
    sent: list[tuple[str, int]] = []

    async def confirming(p2p: object, peer_id: str, request: HandoverRequest, **_: object) -> bool:
        sent.append((peer_id, request.layer))
        return True

    monkeypatch.setattr(handover_module, "call_handover", confirming)
    prompt = torch.randn(6, a.peer.spec.hidden_size, generator=torch.Generator().manual_seed(0))

    async def body() -> None:
        await a.rpc_step(_step(a, 0, prompt), CLIENT)
        await a.rpc_move(MoveRequest("s1", "QmT1", layers=(0, 1)), CLIENT)
        with pytest.raises(ProtocolError, match="cannot go whole"):
            await a.rpc_move(MoveRequest("s1", "QmT2"), CLIENT)
        with pytest.raises(ProtocolError, match="handed over already"):
            await a.rpc_move(MoveRequest("s1", "QmT3", layers=(0, 2)), CLIENT)
        await a.rpc_move(MoveRequest("s1", "QmT4", layers=(1, 2)), CLIENT)
        assert set(sent) == {("QmT1", 0), ("QmT4", 1)}  # (target, layer) of every chunk

    _run([a], body)
