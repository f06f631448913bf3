"""StepBatch / StepBatchReply (steps a hop forwards together, swarm.peer.forwarding): round trip, hostile forms."""

from __future__ import annotations

import msgpack
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import CapacityError, ProtocolError
from swarm.wire import (
    MAX_FORWARDED_STEPS,
    ErrorReply,
    HopTiming,
    StepAck,
    StepBatch,
    StepBatchReply,
    StepReply,
    StepRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

pytestmark = pytest.mark.timeout(30)


def _step(session_id: str) -> StepRequest:
    return StepRequest(
        session_id, 3, torch.randn(1, 16), 0, 2, 64, "hash", wait_result=True, origin="QmClient"
    )


def _raw(kind: str, body: object) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, kind, body], use_bin_type=True)  # type: ignore[no-any-return]


def test_steps_and_outcomes_round_trip_in_order() -> None:
    steps = tuple(_step(f"s{i}") for i in range(5))
    back = decode_request(encode_request(StepBatch(steps)))
    assert isinstance(back, StepBatch) and [s.session_id for s in back.steps] == [f"s{i}" for i in range(5)]
    assert all(
        torch.equal(a.hidden, b.hidden) and b.wait_result for a, b in zip(steps, back.steps, strict=True)
    )
    timing = HopTiming("QmA", 0, 2, 0.1, 0.2, 0.3)
    output = torch.randn(1, 16)
    outcomes = (StepAck((timing,)), ErrorReply("capacity", "full", "QmB"), StepReply(output, (timing,)))
    reply = decode_reply(encode_reply(StepBatchReply(outcomes)))
    assert isinstance(reply, StepBatchReply) and reply.outcomes[:2] == outcomes[:2]
    relayed = reply.outcomes[2]
    assert (
        isinstance(relayed, StepReply)
        and torch.equal(relayed.hidden, output)
        and relayed.timings == (timing,)
    )
    error = reply.outcomes[1]
    assert isinstance(error, ErrorReply) and isinstance(error.to_error(), CapacityError)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"steps": []},
        {"steps": "nope"},
        {"steps": [1]},
        {"steps": [{"session_id": "s"}]},  # a step missing its fields
    ],
)
def test_malformed_step_batches_are_protocol_errors(body: object) -> None:
    with pytest.raises(ProtocolError):
        decode_request(_raw("steps", body))


def test_a_batch_over_the_step_limit_is_refused() -> None:
    one = msgpack.unpackb(encode_request(_step("s")), raw=False)[2]
    with pytest.raises(ProtocolError):
        decode_request(_raw("steps", {"steps": [one] * (MAX_FORWARDED_STEPS + 1)}))


@pytest.mark.parametrize(
    "outcomes",
    [
        [],
        [["step_reply", {"hidden": {}}]],  # a relayed step's output without its tensor
        [["close_reply", {"closed": True}]],  # not an answer to a step
        [["step_ack"]],
        ["step_ack"],
        [["error", {"code": 5}]],
    ],
)
def test_malformed_outcomes_are_protocol_errors(outcomes: object) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(_raw("steps_reply", {"outcomes": outcomes}))
