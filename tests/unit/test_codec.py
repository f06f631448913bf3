"""Activation codecs (swarm.codec) through the wire: round trips, sizes, error bounds, the per-hop choice, and
hostile encodings that must each become a clear ProtocolError."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from swarm import PROTOCOL_VERSION
from swarm.codec import (
    Q8_BLOCK,
    ActivationConfig,
    bytes_per_token,
    choose_codec,
    quantize_q8,
    relative_errors,
    round_trip,
)
from swarm.errors import ProtocolError
from swarm.wire import (
    StepBatch,
    StepReply,
    StepRequest,
    StepWait,
    decode_hidden,
    decode_reply,
    decode_request,
    encode_hidden,
    encode_reply,
    encode_request,
)

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [
    (1, 576),
    (3, 100),
    (2, 16),
    (5, 64),
]  # one token, a part block, a block smaller than Q8_BLOCK, whole


def _step(hidden: torch.Tensor, **fields: Any) -> StepRequest:
    return StepRequest("s1", 0, hidden, 0, 2, 64, "hash", **fields)


def _with_outliers(tokens: int, size: int, seed: int = 0) -> torch.Tensor:
    """Normal values, with a few channels hundreds of times larger (as real LLM hidden states have)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, size, generator=generator)
    hidden[:, [3 % size, (size // 2) % size]] *= 800.0
    return hidden


def _q8_bound(hidden: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of q8's error: half a step of the value's block (its absmax but the peak / 127 / 2)."""
    scales = quantize_q8(hidden).scales
    return scales.repeat_interleave(Q8_BLOCK, dim=1)[:, : hidden.shape[1]] / 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_codec_round_trips_a_step_within_its_bound(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    hidden = _with_outliers(*shape).to(dtype)
    exact = decode_request(encode_request(_step(hidden)))
    assert isinstance(exact, StepRequest) and exact.codec == "exact" and torch.equal(exact.hidden, hidden)

    f16 = decode_request(encode_request(_step(hidden, codec="f16")))
    assert isinstance(f16, StepRequest) and f16.codec == "f16" and f16.hidden.shape == hidden.shape
    assert f16.hidden.dtype == (torch.float16 if dtype == torch.float32 else dtype)
    error = (f16.hidden.float() - hidden.float()).abs()
    assert bool((error <= hidden.float().abs() * 2**-11).all())  # float16 rounding, values in its range

    q8 = decode_request(encode_request(_step(hidden, codec="q8")))
    assert isinstance(q8, StepRequest) and q8.codec == "q8"
    assert q8.hidden.dtype == dtype and q8.hidden.shape == hidden.shape  # back in the dtype it was sent from
    error = (q8.hidden.float() - hidden.float()).abs()
    rounding = hidden.float().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-10)  # the dtype's own
    assert bool((error <= _q8_bound(hidden.float()) * 1.001 + rounding).all())


def test_q8_carries_a_third_of_a_float32_step_and_f16_half() -> None:
    hidden = torch.randn(64, 576)
    sizes = {c: len(encode_request(_step(hidden, codec=c))) for c in ("exact", "f16", "q8")}
    assert sizes["exact"] > 4 * 64 * 576 and sizes["f16"] < 0.51 * sizes["exact"]
    assert sizes["q8"] < 0.33 * sizes["exact"]
    assert bytes_per_token("q8", torch.float32, 576) == 576 + 9 * 576 // Q8_BLOCK
    assert bytes_per_token("exact", torch.bfloat16, 576) == bytes_per_token("f16", torch.float32, 576)


def test_f16_falls_back_to_bfloat16_past_float16s_range_instead_of_sending_infinities() -> None:
    hidden = torch.randn(2, 64)
    hidden[0, 5] = 1e6
    back, codec = decode_hidden(encode_hidden(hidden, "f16"))
    assert codec == "f16" and back.dtype == torch.bfloat16 and bool(torch.isfinite(back).all())
    assert float(relative_errors(hidden, back).max()) < 2**-8


def test_q8_keeps_zero_blocks_zero_peaks_exact_and_per_token_error_small_with_outliers() -> None:
    hidden = _with_outliers(8, 576)
    hidden[2] = 0.0
    back = round_trip(hidden, "q8")
    assert bool((back[2] == 0).all())
    assert torch.equal(back[:, 3], hidden[:, 3]) and torch.equal(back[:, 288], hidden[:, 288])  # the outliers
    small = hidden.clone()
    small[:, [3, 288]] = 0.0
    block = slice(4, Q8_BLOCK)  # the first outlier's block, less the outlier
    assert float((back - hidden)[:, block].abs().max()) < 0.05 * float(small[:, block].abs().max())
    rows = [0, 1, 3]
    errors = relative_errors(hidden[rows], back[rows])
    bounds = _q8_bound(hidden[rows]).norm(dim=-1) / hidden[rows].norm(dim=-1)
    assert bool((errors <= bounds * 1.001).all()) and float(errors.max()) < 0.03


def test_waits_replies_and_batches_carry_their_codecs_and_exact_keeps_the_old_bytes() -> None:
    hidden = torch.randn(1, 16)
    assert "codec" not in msgpack.unpackb(encode_request(StepWait("s", 3, 5.0)), raw=False)[2]
    assert decode_request(encode_request(StepWait("s", 3, 5.0, "q8"))) == StepWait("s", 3, 5.0, "q8")
    reply = decode_reply(encode_reply(StepReply(hidden, (), "f16")))
    assert isinstance(reply, StepReply) and reply.codec == "f16" and reply.hidden.dtype == torch.float16
    batch = decode_request(encode_request(StepBatch((_step(hidden, codec="q8"), _step(hidden)))))
    assert isinstance(batch, StepBatch) and [s.codec for s in batch.steps] == ["q8", "exact"]
    pinned = decode_request(encode_request(_step(hidden, lossless=True)))
    assert isinstance(pinned, StepRequest) and pinned.lossless
    body = msgpack.unpackb(encode_request(_step(hidden)), raw=False)[2]
    assert "lossless" not in body and "codec" not in body["hidden"]


def test_the_choice_per_hop() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert choose_codec("exact", f32, 576, 1.0, 1.0) == "exact"
    assert choose_codec("q8", f32, 576) == "q8"
    assert choose_codec("f16", f32, 576) == "f16"
    assert choose_codec("f16", bf16, 576) == "exact", "a 16-bit model's states are 16-bit already"
    assert choose_codec("auto", f32, 576, None, 1e-3) == "exact", "an unmeasured link stays exact"
    assert choose_codec("auto", f32, 576, 1e6, None) == "exact"
    # 1 ms a token of compute, a quarter of it for the transfer: 250 us for 2304 bytes exact, 1152 in f16
    assert choose_codec("auto", f32, 576, 1e8, 1e-3, 0.25) == "exact"
    assert choose_codec("auto", f32, 576, 6e6, 1e-3, 0.25) == "f16"
    assert choose_codec("auto", f32, 576, 3e6, 1e-3, 0.25) == "q8"
    assert choose_codec("auto", f32, 576, 1e3, 1e-3, 0.25) == "q8", "the lightest when none fits"
    assert choose_codec("auto", bf16, 576, 3e6, 1e-3, 0.25) == "q8", "16-bit models skip f16"
    with pytest.raises(ValueError, match="activations mode"):
        ActivationConfig(mode="q4")
    with pytest.raises(ValueError, match="auto_fraction"):
        ActivationConfig(auto_fraction=0.0)


SIZE = Q8_BLOCK + Q8_BLOCK // 2 + 2  # two blocks a token, the last one part full
LAST = SIZE - Q8_BLOCK  # values in the last block


def _q8_body(tokens: int = 2, size: int = SIZE, **changes: Any) -> dict[str, Any]:
    encoded = encode_hidden(torch.randn(tokens, size), "q8")
    body = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in encoded.items()}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def _scales(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


def _index(*values: int) -> bytes:
    return bytes(values)


HOSTILE = [
    ({"codec": "q4"}, "unknown codec"),
    ({"codec": "exact", "dtype": "float32"}, "unknown codec"),  # exact is written by leaving codec out
    ({"codec": 8}, "unknown codec"),
    ({"dtype": "int8"}, "unsupported dtype"),
    ({"dtype": None}, "dtype must be a string"),
    ({"shape": [2, SIZE, 1]}, r"\[tokens, hidden_size\]"),
    ({"shape": [2]}, r"\[tokens, hidden_size\]"),
    ({"shape": [2, True]}, r"\[tokens, hidden_size\]"),
    ({"shape": [2, float(SIZE)]}, r"\[tokens, hidden_size\]"),
    ({"shape": [0, SIZE]}, "past the limits"),
    ({"shape": [2, -SIZE]}, "past the limits"),
    ({"shape": [2, 1 << 40]}, "past the limits"),
    ({"shape": [60_000, 60_000]}, "tensor limit"),
    (
        {"shape": [65_536, 1024]},
        "unpacks past",
    ),  # within the limit as int8, past it as the float32 it decodes to
    ({"shape": [3, SIZE]}, "values of data"),  # the data of 2 tokens named as 3
    ({"shape": [2, SIZE - 1]}, "values of data"),
    ({"data": b"\x01" * (2 * SIZE - 1)}, "values of data"),
    ({"data": "x" * (2 * SIZE)}, "must be bytes"),
    ({"scales": None}, "must be bytes"),
    ({"scales": _scales(1.0, 1.0)}, "4 values of scales"),  # 2 scales where 2 tokens x 2 blocks need 4
    ({"scales": _scales(1.0, 1.0, 1.0, 1.0) + b"\x00"}, "4 values of scales"),
    ({"scales": _scales(1.0, float("nan"), 1.0, 1.0)}, "finite and non-negative"),
    ({"scales": _scales(1.0, float("inf"), 1.0, 1.0)}, "finite and non-negative"),
    ({"scales": _scales(1.0, -1.0, 1.0, 1.0)}, "finite and non-negative"),
    ({"dtype": "float16", "scales": _scales(1e30, 1.0, 1.0, 1.0)}, "NaN or infinity"),  # overflows float16
    ({"peaks": None}, "peaks must be bytes"),
    ({"peaks": _scales(1.0, 2.0, 3.0)}, "4 values of peaks"),
    ({"peaks": _scales(1.0, float("inf"), 3.0, 4.0)}, "peaks must be finite"),
    ({"peaks": _scales(1.0, float("nan"), 3.0, 4.0)}, "peaks must be finite"),
    ({"dtype": "float16", "peaks": _scales(1e30, 1.0, 1.0, 1.0)}, "NaN or infinity"),
    ({"peak_index": None}, "peak_index must be bytes"),
    ({"peak_index": _index(0, 1, 2)}, "4 values of peak_index"),
    ({"peak_index": _index(Q8_BLOCK, 0, 0, 0)}, "past its block"),
    ({"peak_index": _index(0, LAST, 0, 0)}, "past its block"),
    ({"peak_index": _index(0, 0, 0, 255)}, "past its block"),
]


@pytest.mark.parametrize(("changes", "error"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
@pytest.mark.parametrize("kind", ["step", "step_reply"])
def test_hostile_lighter_states_are_protocol_errors(changes: dict[str, Any], error: str, kind: str) -> None:
    hidden = torch.randn(2, SIZE)
    frame = encode_request(_step(hidden)) if kind == "step" else encode_reply(StepReply(hidden))
    version, _, body = msgpack.unpackb(frame, raw=False)
    body["hidden"] = _q8_body(**changes)
    decode = decode_request if kind == "step" else decode_reply
    with pytest.raises(ProtocolError, match=error):
        decode(msgpack.packb([version, kind, body], use_bin_type=True))


def test_hostile_codec_fields_are_protocol_errors() -> None:
    hidden = torch.randn(1, 16)
    f16 = encode_hidden(hidden, "exact") | {"codec": "f16"}  # f16 that is float32
    with pytest.raises(ProtocolError, match="f16 states must be float16"):
        decode_hidden(f16)
    with pytest.raises(ProtocolError, match="NaN or infinity"):
        _, _, body = msgpack.unpackb(encode_request(_step(hidden)), raw=False)
        body["hidden"] = encode_hidden(torch.full((1, 16), float("inf")), "f16")
        decode_request(msgpack.packb([PROTOCOL_VERSION, "step", body], use_bin_type=True))
    for field, value in (("codec", "q4"), ("codec", 1), ("codec", None)):
        wait = msgpack.unpackb(encode_request(StepWait("s", 0, 1.0)), raw=False)
        wait[2][field] = value
        with pytest.raises(ProtocolError, match="wait.codec"):
            decode_request(msgpack.packb(wait, use_bin_type=True))
    step = msgpack.unpackb(encode_request(_step(hidden)), raw=False)
    step[2]["lossless"] = 1
    with pytest.raises(ProtocolError, match="lossless must be a bool"):
        decode_request(msgpack.packb(step, use_bin_type=True))
    with pytest.raises(ValueError, match="unknown activation codec"):
        encode_hidden(hidden, "q4")


def test_q8_states_decode_unsent_as_sent() -> None:
    hidden = torch.randn(3, SIZE)
    body = encode_hidden(hidden, "q8")
    assert len(body["data"]) == 3 * SIZE and len(body["scales"]) == len(body["peaks"]) == 3 * 2 * 4
    assert len(body["peak_index"]) == 3 * 2
    back, codec = decode_hidden(body)
    assert codec == "q8" and torch.equal(back, round_trip(hidden, "q8"))
