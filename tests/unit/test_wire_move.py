"""MoveRequest / MoveReply (a client moving its session to another peer): round trips and hostile forms."""

from __future__ import annotations

import msgpack
import pytest

from swarm import PROTOCOL_VERSION
from swarm.errors import ProtocolError
from swarm.wire import (
    MAX_MADDRS,
    MoveReply,
    MoveRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    request_verb,
)

pytestmark = pytest.mark.timeout(30)

MOVE = MoveRequest("abc123", "QmTarget", ("/ip4/127.0.0.1/tcp/1/p2p/QmTarget",), "QmClient")


def _with(**body: object) -> bytes:
    version, kind, fields = msgpack.unpackb(encode_request(MOVE), raw=False)
    assert (version, kind) == (PROTOCOL_VERSION, "move")
    return msgpack.packb([version, kind, {**fields, **body}], use_bin_type=True)  # type: ignore[no-any-return]


def test_move_messages_round_trip() -> None:
    assert decode_request(encode_request(MOVE)) == MOVE
    assert request_verb(MOVE) == "move"
    bare = MoveRequest("abc123", "QmTarget")  # no maddrs, no origin: the caller is the client
    assert decode_request(encode_request(bare)) == bare
    part = MoveRequest("abc123", "QmTarget", layers=(3, 6))  # a part of the session's layers
    assert decode_request(encode_request(part)) == part
    assert decode_reply(encode_reply(MoveReply(2048, 31_457_280))) == MoveReply(2048, 31_457_280)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"target_peer_id": ""}, "must name a peer"),
        ({"target_peer_id": 7}, "target_peer_id"),
        ({"target_peer_id": "Q" * 200}, "target_peer_id"),
        ({"target_maddrs": ["/ip4/1.2.3.4"] * (MAX_MADDRS + 1)}, "maddrs"),
        ({"target_maddrs": [b"bytes"]}, "maddrs"),
        ({"session_id": None}, "session_id"),
        ({"origin": 1}, "origin"),
        ({"start": 3}, "end"),  # a part names both ends
        ({"start": 3, "end": 3}, "empty layer range"),
        ({"start": -1, "end": 3}, "start"),
        ({"start": 0, "end": "6"}, "end"),
    ],
)
def test_hostile_move_requests_are_protocol_errors(body: dict[str, object], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        decode_request(_with(**body))


def test_a_move_reply_with_a_negative_length_is_refused() -> None:
    data = msgpack.packb([PROTOCOL_VERSION, "move_reply", {"tokens": -1, "kv_bytes": 0}], use_bin_type=True)
    with pytest.raises(ProtocolError, match="tokens"):
        decode_reply(data)
