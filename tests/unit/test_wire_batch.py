"""A decode step's batch fields (StepRequest.batch_id / batch_size): round trip, old bytes, hostile forms."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ProtocolError
from swarm.wire import MAX_BATCH_STEPS, StepRequest, decode_request, encode_request
from tests.unit.test_wire_resend import _body, _decode

pytestmark = pytest.mark.timeout(30)


def _step(**overrides: object) -> StepRequest:
    fields: dict[str, object] = dict(
        session_id="abc123",
        position=7,
        hidden=torch.randn(1, 16),
        start=0,
        end=2,
        max_length_tokens=64,
        model_hash="deadbeef",
    )
    fields.update(overrides)
    return StepRequest(**fields)  # type: ignore[arg-type]


def test_batch_fields_round_trip() -> None:
    back = decode_request(encode_request(_step(batch_id="r0und", batch_size=8)))
    assert isinstance(back, StepRequest) and (back.batch_id, back.batch_size) == ("r0und", 8)


def test_a_step_sent_alone_keeps_its_old_bytes() -> None:
    body = _body(_step())
    assert "batch_id" not in body and "batch_size" not in body
    back = decode_request(encode_request(_step()))
    assert isinstance(back, StepRequest) and (back.batch_id, back.batch_size) == ("", 1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_size", 0),
        ("batch_size", -3),
        ("batch_size", MAX_BATCH_STEPS + 1),
        ("batch_size", 2**64 - 1),
        ("batch_size", "8"),
        ("batch_size", True),
        ("batch_size", 2.5),
        ("batch_id", 12),
        ("batch_id", "x" * 65),
        ("batch_id", b"bytes"),
    ],
)
def test_hostile_batch_fields_are_refused(field: str, value: object) -> None:
    body = _body(_step(batch_id="r", batch_size=2))
    body[field] = value
    with pytest.raises(ProtocolError, match=field):
        _decode(body)
