"""The wire format, pinned: every message kind encodes to the exact bytes in ``wire_golden.json``.

A change to how any message is laid out on the wire fails here, so it cannot happen silently: peers of the
previous release may misread it. If the change is intended, bump ``swarm.PROTOCOL_VERSION`` (unless the old
release still reads the new bytes and the new one the old, as with an added optional field) and regenerate:

    .venv/bin/python -m tests.unit.test_wire_golden
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.wire import (
    CloseReply,
    CloseRequest,
    ErrorReply,
    Hop,
    HopTiming,
    InfoReply,
    InfoRequest,
    ProbeReply,
    ProbeRequest,
    Reply,
    Request,
    StepAck,
    StepBatch,
    StepBatchReply,
    StepReply,
    StepRequest,
    StepWait,
    StepWaits,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

GOLDEN = Path(__file__).with_name("wire_golden.json")
ROUTE = (Hop("QmNext", ("/ip4/127.0.0.1/tcp/4001/p2p/QmNext",), 2, 4),)


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4).to(dtype)


def messages() -> dict[str, Request | Reply]:
    """One message of every kind, every field set, built deterministically."""
    return {
        "step_request_f32": StepRequest("sess", 5, _tensor(torch.float32), 0, 2, 64, "hash", ROUTE),
        "step_request_bf16": StepRequest("sess", 0, _tensor(torch.bfloat16), 0, 2, 64, "hash"),
        "step_request_wait_result": StepRequest(
            "sess", 5, _tensor(torch.float32), 0, 2, 64, "hash", ROUTE, 30.0, wait_result=True
        ),
        "step_ack": StepAck((HopTiming("QmA", 0, 2, 0.25, 0.5, 1.0),)),
        "steps_request": StepBatch(
            (
                StepRequest(
                    "sess", 5, _tensor(torch.float32)[:1], 0, 2, 64, "hash", ROUTE, 30.0, wait_result=True
                ),
            )
        ),
        "steps_reply": StepBatchReply(
            (StepAck((HopTiming("QmA", 0, 2, 0.25, 0.5, 1.0),)), ErrorReply("capacity", "full", "QmA"))
        ),
        "step_wait_request": StepWait("sess", 5, 30.0),
        "waits_request": StepWaits((StepWait("sess", 5, 30.0), StepWait("other", 7, 30.0))),
        "step_reply": StepReply(_tensor(torch.float16), (HopTiming("QmA", 0, 2, 0.25, 0.5, 1.0),)),
        "close_request": CloseRequest("sess", ROUTE),
        "close_reply": CloseReply(True),
        "info_request": InfoRequest(),
        "info_reply": InfoReply("QmA", "a", "tiny", "hash", 6, 64, "float32", 0, 2, 64, 32, 1, "serving"),
        "probe_request": ProbeRequest(b"abc", 4, "QmBack", ("/ip4/127.0.0.1/tcp/5",)),
        "probe_reply": ProbeReply("QmA", 3, b"\x00\x00", False, "refused"),
        "error_reply": ErrorReply("capacity", "full", "QmA"),
    }


def _encode(message: Request | Reply) -> bytes:
    if isinstance(
        message, StepRequest | StepBatch | StepWait | StepWaits | CloseRequest | InfoRequest | ProbeRequest
    ):
        return encode_request(message)
    return encode_reply(message)


def _same(a: object, b: object) -> bool:
    if isinstance(a, StepBatch) and isinstance(b, StepBatch):
        return len(a.steps) == len(b.steps) and all(
            _same(x, y) for x, y in zip(a.steps, b.steps, strict=True)
        )
    if isinstance(a, StepRequest | StepReply) and isinstance(b, type(a)):
        return (
            torch.equal(a.hidden, b.hidden) and a.hidden.dtype == b.hidden.dtype and _fields(a) == _fields(b)
        )
    return a == b


def _fields(message: object) -> dict[str, object]:
    return {k: v for k, v in vars(message).items() if k != "hidden"}


@pytest.mark.parametrize("name", sorted(messages()))
def test_every_message_encodes_to_its_golden_bytes(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == set(messages()), "a message kind was added or removed: regenerate the fixtures"
    assert _encode(messages()[name]).hex() == golden[name], (
        f"the wire encoding of {name} changed: bump PROTOCOL_VERSION and regenerate (see this module's docstring)"
    )


@pytest.mark.parametrize("name", sorted(messages()))
def test_golden_bytes_decode_to_the_same_message(name: str) -> None:
    data = bytes.fromhex(json.loads(GOLDEN.read_text())[name])
    message = messages()[name]
    decoded = decode_request(data) if name.endswith("request") or "request_" in name else decode_reply(data)
    assert _same(decoded, message)


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({k: _encode(v).hex() for k, v in messages().items()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
