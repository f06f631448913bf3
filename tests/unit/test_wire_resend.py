"""The resend step (StepRequest.resend_tokens): its round trip and the hostile forms a peer must refuse."""

from __future__ import annotations

import msgpack
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.errors import ProtocolError
from swarm.wire import MAX_TOKENS, Hop, StepRequest, decode_request, encode_request

pytestmark = pytest.mark.timeout(30)

ROUTE = (Hop("QmPeerA", ("/ip4/127.0.0.1/tcp/1/p2p/QmPeerA",), 2, 4),)


def _resend(**overrides: object) -> StepRequest:
    fields: dict[str, object] = dict(
        session_id="abc123",
        position=0,
        hidden=torch.empty(0, 16),
        start=0,
        end=2,
        max_length_tokens=64,
        model_hash="deadbeef",
        route_rest=ROUTE,
        wait_result=True,
        resend_tokens=40,
    )
    fields.update(overrides)
    return StepRequest(**fields)  # type: ignore[arg-type]


def _body(request: StepRequest) -> dict[str, object]:
    version, kind, body = msgpack.unpackb(encode_request(request), raw=False)
    assert (version, kind) == (PROTOCOL_VERSION, "step")
    return body  # type: ignore[no-any-return]


def _decode(body: dict[str, object]) -> object:
    return decode_request(msgpack.packb([PROTOCOL_VERSION, "step", body], use_bin_type=True))


def test_a_resend_round_trips_with_only_the_hidden_size_on_the_wire() -> None:
    body = _body(_resend())
    assert "hidden" not in body and (body["hidden_size"], body["resend_tokens"]) == (16, 40)
    back = decode_request(encode_request(_resend()))
    assert isinstance(back, StepRequest)
    assert (back.resend_tokens, back.position, back.route_rest, back.wait_result) == (40, 0, ROUTE, True)
    assert back.hidden.shape == (0, 16)


def test_an_ordinary_step_has_no_resend_field_on_the_wire() -> None:
    step = _resend(hidden=torch.randn(3, 16), resend_tokens=0)
    body = _body(step)
    assert "resend_tokens" not in body and "hidden_size" not in body  # the old bytes
    back = decode_request(encode_request(step))
    assert isinstance(back, StepRequest) and back.resend_tokens == 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: b.update(resend_tokens=0), "resend_tokens"),
        (lambda b: b.update(resend_tokens=-3), "resend_tokens"),
        (lambda b: b.update(resend_tokens=MAX_TOKENS + 1), "resend_tokens"),
        (lambda b: b.update(resend_tokens="40"), "resend_tokens"),
        (lambda b: b.update(resend_tokens=True), "resend_tokens"),
        (lambda b: b.update(resend_tokens=65), "past max_length_tokens"),  # 0 + 65 > 64
        (lambda b: b.update(position=30), "past max_length_tokens"),  # 30 + 40 > 64
        (lambda b: b.update(route_rest=[]), "route_rest is empty"),
        (lambda b: b.pop("route_rest"), "route_rest is empty"),
        (lambda b: b.pop("hidden_size"), "hidden_size"),
        (lambda b: b.update(hidden_size=0), "hidden_size"),
        (lambda b: b.update(hidden_size=1 << 30), "hidden_size"),
        (lambda b: b.update(hidden={"dtype": "float32", "shape": [1, 16], "data": bytes(64)}), "no hidden"),
    ],
)
def test_a_malformed_resend_is_a_protocol_error(change, match) -> None:  # type: ignore[no-untyped-def]
    body = _body(_resend())
    change(body)
    with pytest.raises(ProtocolError, match=match):
        _decode(body)
