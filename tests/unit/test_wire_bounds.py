"""Decoding is bounded before allocation: msgpack bombs, oversized frames and big messages off the event loop.

Memory is measured with tracemalloc inside the test (a bound on what the decoder allocates, not a timing).
"""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
from collections.abc import Callable

import msgpack
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import ProtocolError
from swarm.transport import serving
from swarm.transport.channel import OFF_LOOP_BYTES
from swarm.wire import (
    MAX_STRUCTURE_BYTES,
    CloseReply,
    CloseRequest,
    ErrorReply,
    ProbeReply,
    ProbeRequest,
    Reply,
    Request,
    StepReply,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

pytestmark = pytest.mark.timeout(30)

BOUND_BYTES = 8 * 1024**2  # what decoding any bomb below may allocate; main allocated 64 MB to 80 MB


def _envelope(kind: str, body_bytes: bytes) -> bytes:
    """[version, kind, {"session_id": <body_bytes>}], the body written as raw msgpack."""
    head = msgpack.packb([PROTOCOL_VERSION, kind], use_bin_type=True)[1:]  # drop the 2-array header
    return b"\x93" + head + b"\x81" + msgpack.packb("session_id") + body_bytes


def _wide_bomb(lists: int, row: int = 250) -> bytes:
    """About ``lists`` empty arrays in nested rows of ``row`` (under every array limit): about one byte each on
    the wire, ~60 bytes each once decoded."""
    level: list[object] = [[]] * row
    count = row
    while count * row <= lists:
        level, count = [level] * row, count * row
    return msgpack.packb([level] * (lists // count))


def _deep_bomb(depth: int = 1000, declared: int = 10_000, filler_bytes: int = 10**6) -> bytes:
    """Arrays nested ``depth`` deep, each declaring ``declared`` elements, then nils that never fill them."""
    return (b"\xdc" + declared.to_bytes(2, "big")) * depth + b"\xc0" * filler_bytes


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
    except ProtocolError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    ("body", "decode"),
    [
        (_wide_bomb(10**6), decode_request),
        (_wide_bomb(10**6), decode_reply),
        (_deep_bomb(), decode_request),
        (msgpack.packb([{str(i): [] for i in range(16)}] * 70_000), decode_request),
    ],
    ids=["wide-request", "wide-reply", "deep-request", "maps-request"],
)
def test_a_msgpack_bomb_is_refused_with_bounded_memory(
    body: bytes, decode: Callable[[bytes], object]
) -> None:
    kind = "close" if decode is decode_request else "close_reply"
    data = _envelope(kind, body)
    with pytest.raises(ProtocolError):
        decode(data)
    peak = _peak_bytes(lambda: decode(data))
    assert peak < BOUND_BYTES, f"decoding a {len(data)}-byte bomb allocated {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("kind", ["close", "step"])
def test_a_50_mb_bomb_is_refused_with_bounded_memory(kind: str) -> None:
    """A close may not weigh 50 MB at all; a step may (a tensor), but not in objects."""
    data = _envelope(kind, _wide_bomb(50 * 10**6))
    with pytest.raises(ProtocolError, match="over its" if kind == "close" else "objects"):
        decode_request(data)
    assert _peak_bytes(lambda: decode_request(data)) < BOUND_BYTES


def test_a_step_may_weigh_a_tensor_but_a_close_may_not() -> None:
    pad = {"session_id": "s", "route_rest": [], "pad": b"\0" * (MAX_STRUCTURE_BYTES + 1)}
    with pytest.raises(ProtocolError, match="close message of .* over its"):
        decode_request(msgpack.packb([PROTOCOL_VERSION, "close", pad], use_bin_type=True))
    assert decode_request(encode_request(CloseRequest("s"))) == CloseRequest("s")


def test_the_version_is_checked_before_the_body_is_unpacked() -> None:
    data = b"\x93" + msgpack.packb(PROTOCOL_VERSION + 1) + msgpack.packb("close") + _wide_bomb(10**6)
    with pytest.raises(ProtocolError, match="protocol version"):
        decode_request(data)
    assert _peak_bytes(lambda: decode_request(data)) < BOUND_BYTES


class _Prober:
    peer_id = "QmSelf"

    async def rpc_probe(self, request: ProbeRequest, remote_id: str) -> ProbeReply:
        return ProbeReply(self.peer_id, len(request.payload))


def test_big_requests_are_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def recording_decode(data: bytes) -> Request:
        threads.append(threading.current_thread().name)
        return decode_request(data)

    monkeypatch.setattr(serving, "decode_request", recording_decode)

    async def main() -> list[object]:
        replies = []
        for size in (10, OFF_LOOP_BYTES + 1):
            raw = await serving.dispatch(_Prober(), encode_request(ProbeRequest(b"x" * size)), "QmClient")  # type: ignore[arg-type]
            replies.append(decode_reply(raw))
        return replies

    small, big = asyncio.run(main())
    assert small == ProbeReply("QmSelf", 10) and big == ProbeReply("QmSelf", OFF_LOOP_BYTES + 1)
    loop_thread = threading.main_thread().name
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_garbage_still_gets_an_error_reply_from_dispatch() -> None:
    raw = asyncio.run(serving.dispatch(_Prober(), _envelope("close", _wide_bomb(10**6)), "Qm"))  # type: ignore[arg-type]
    reply = decode_reply(raw)
    assert isinstance(reply, ErrorReply) and reply.code == "protocol"
    assert not isinstance(reply, CloseReply)


class _Replier:
    peer_id = "QmSelf"

    async def rpc_close(self, request: CloseRequest, remote_id: str) -> StepReply:
        return StepReply(torch.zeros(int(request.session_id), 64))  # a reply of the asked number of tokens


def test_big_replies_are_encoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def recording_encode(reply: Reply) -> bytes:
        threads.append(threading.current_thread().name)
        return encode_reply(reply)

    monkeypatch.setattr(serving, "encode_reply", recording_encode)
    big_tokens = OFF_LOOP_BYTES // (64 * 4) + 1  # float32 states just over the bound

    async def main() -> list[Reply]:
        replies = []
        for tokens in (2, big_tokens):
            raw = await serving.dispatch(_Replier(), encode_request(CloseRequest(str(tokens))), "QmClient")  # type: ignore[arg-type]
            replies.append(decode_reply(raw))
        return replies

    small, big = asyncio.run(main())
    assert isinstance(small, StepReply) and small.hidden.shape == (2, 64)
    assert isinstance(big, StepReply) and big.hidden.shape == (big_tokens, 64)
    loop_thread = threading.main_thread().name
    assert threads[0] == loop_thread and threads[1] != loop_thread
