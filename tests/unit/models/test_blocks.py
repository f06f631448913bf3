"""BlockRange on the tiny seeded Llama: exactness vs transformers, sessions, batching, replay, errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client.local import in_process_client
from swarm.errors import CapacityError, ProtocolError, SessionError
from swarm.models import SamplingParams, Step
from swarm.models.backends.cpu import range as cpu_range
from swarm.models.backends.cpu.matmul import (
    MAX_FEW_ROWS,
    PACKED_TIMED_ROWS,
    PLAIN,
    Forms,
    packers,
    packing_available,
)
from swarm.models.backends.generic import TorchHead, TorchRange

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300]


@pytest.fixture(scope="module")
def reference(tiny_source):  # type: ignore[no-untyped-def]
    return tiny_source.load_reference_model()


FORMS = {
    "few_columns": Forms(few_rows=MAX_FEW_ROWS),
    **{
        f"packed_{packer}": Forms(packer=packer, packed_rows=frozenset(PACKED_TIMED_ROWS), packed_beyond=True)
        for packer in ("onednn", "mkl")
    },
}


@pytest.fixture(params=["measured", "generic", *FORMS])
def forms(request) -> Forms | str | None:  # type: ignore[no-untyped-def]
    """The matmul forms: what calibration chose on this CPU, the generic torch backend (what a GPU runs), the
    few-columns form for every decode step, or a packed copy of the weights for every input (whichever this
    machine picks, each must stay exact)."""
    if request.param == "generic":
        return "generic"
    chosen = FORMS.get(request.param)
    if chosen is not None and chosen.packer and chosen.packer not in packers():
        pytest.skip(f"this torch has no {chosen.packer} packed weights")
    return chosen


@pytest.fixture()
def head(tiny_source, forms):  # type: ignore[no-untyped-def]
    part = tiny_source.load_head()
    if forms == "generic":
        part.kernels = TorchHead(part.lm_head_weight)
    elif forms is not None:
        part.kernels.use_forms(forms)
    return part


def _blocks(tiny_source, start: int, end: int, forms: Forms | str | None):  # type: ignore[no-untyped-def]
    part = tiny_source.load_blocks(start, end, cache_tokens=1000)
    if forms == "generic":
        part.kernels = TorchRange(list(part.layers), start, part.kernels.shape)
    elif forms is not None:
        part.kernels.use_forms(forms)
    return part


@pytest.fixture()
def split(tiny_source, forms):  # type: ignore[no-untyped-def]
    return [_blocks(tiny_source, a, b, forms) for a, b in [(0, 2), (2, 4), (4, 6)]]


@pytest.fixture()
def whole(tiny_source, forms):  # type: ignore[no-untyped-def]
    return _blocks(tiny_source, 0, 6, forms)


def test_hidden_states_match_transformers(split, head, reference) -> None:  # type: ignore[no-untyped-def]
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = reference(ids[None], output_hidden_states=True)
    hidden = head.embed(ids)
    for block in split:
        hidden = block.forward([Step(None, hidden, block.range.start, block.range.end, 0)])[0]
        if block.range.end < 6:
            assert (hidden - out.hidden_states[block.range.end][0]).abs().max().item() <= 1e-5
    assert (head.logits(hidden) - out.logits[0]).abs().max().item() <= 1e-4


def test_greedy_generation_matches_transformers(split, head, reference) -> None:  # type: ignore[no-untyped-def]
    """Through the client's in-process chain (one InferenceSession, the client's decode loop)."""
    ids = torch.tensor([PROMPT])
    reference.generation_config.eos_token_id = (
        None  # (None in generate()'s kwargs would mean "model default")
    )
    expected = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
    )
    client = in_process_client(head, {f"peer-{i}": block for i, block in enumerate(split)})
    got = asyncio.run(client.generate_ids(PROMPT, 32, SamplingParams()))
    assert got == expected[0, len(PROMPT) :].tolist()
    assert all(block.active_sessions == [] for block in split)  # the session was closed on every range


def test_stateless_greedy_generation_matches_transformers(split, head, reference) -> None:  # type: ignore[no-untyped-def]
    """No session: every step recomputes the whole prefix, which must give the same tokens as a KV cache."""
    ids = torch.tensor([PROMPT])
    reference.generation_config.eos_token_id = None
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    tokens = list(PROMPT)
    for _ in range(8):
        hidden = _through(split, head.embed(torch.tensor(tokens)), None, 0)
        tokens.append(int(head.logits(hidden[-1]).argmax()))
    assert tokens == expected[0].tolist()


def _through(blocks, hidden: torch.Tensor, session: str | None, position: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """hidden [T, H] through each block's whole range in turn."""
    for block in blocks:
        hidden = block.forward([Step(session, hidden, block.range.start, block.range.end, position)])[0]
    return hidden


def _prefill_and_decode(block, head, session: str, prompt: list[int], steps: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Run one session alone: prefill, then greedy decode; returns each step's last hidden state."""
    block.open_session(session, len(prompt) + steps)
    out = block.forward([Step(session, head.embed(torch.tensor(prompt)), 0, 6, 0)])[0]
    hiddens = [out[-1]]
    for i in range(steps):
        token = int(head.logits(hiddens[-1]).argmax())
        out = block.forward([Step(session, head.embed(torch.tensor([token])), 0, 6, len(prompt) + i)])[0]
        hiddens.append(out[-1])
    return hiddens


def test_batched_decode_equals_separate_runs(tiny_source, head, whole) -> None:  # type: ignore[no-untyped-def]
    prompts = {"a": PROMPT[:2], "b": PROMPT, "c": PROMPT[:5]}
    alone = tiny_source.load_blocks(0, 6, cache_tokens=1000)
    expected = {s: _prefill_and_decode(alone, head, s, p, 6) for s, p in prompts.items()}

    last = {}
    for session, prompt in prompts.items():
        whole.open_session(session, len(prompt) + 6)
        last[session] = whole.forward([Step(session, head.embed(torch.tensor(prompt)), 0, 6, 0)])[0][-1]
    for i in range(6):
        steps = [
            Step(s, head.embed(torch.tensor([int(head.logits(last[s]).argmax())])), 0, 6, len(p) + i)
            for s, p in prompts.items()
        ]
        for step, out in zip(steps, whole.forward(steps), strict=True):
            assert step.session_id is not None
            last[step.session_id] = out[-1]
            assert (out[-1] - expected[step.session_id][i + 1]).abs().max().item() <= 1e-5
    assert all(whole.session_length(s, 5) == len(p) + 6 for s, p in prompts.items())


def test_decode_steps_and_prefill_chunks_in_one_forward_equal_separate_runs(tiny_source) -> None:  # type: ignore[no-untyped-def]
    """One forward of: a first prefill chunk (position 0), a later chunk (position 5, attends to its cache),
    and two decode steps of other sessions: each output and each cache equal running the steps one by one."""
    hidden = torch.randn(12, tiny_source.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    prepared = {"p1": hidden[:5], "d1": hidden[:3], "d2": hidden[:7]}
    steps = [
        Step("p0", hidden[:4], 0, 6, 0),
        Step("d1", hidden[9:10], 0, 6, 3),
        Step("p1", hidden[5:11], 0, 6, 5),
        Step("d2", hidden[11:12], 0, 6, 7),
    ]
    outputs = {}
    for mixed in (True, False):
        blocks = tiny_source.load_blocks(0, 6, cache_tokens=1000)
        for session in ("p0", "p1", "d1", "d2"):
            blocks.open_session(session, 16)
        for session, prefix in prepared.items():
            blocks.forward([Step(session, prefix, 0, 6, 0)])
        outs = blocks.forward(steps) if mixed else [blocks.forward([step])[0] for step in steps]
        after = [
            blocks.forward([Step(s, hidden[:1], 0, 6, blocks.session_length(s, 5))])[0] for s in prepared
        ]
        outputs[mixed] = [*outs, *after]
    for got, want in zip(outputs[True], outputs[False], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sub_range_steps_inside_a_block(head, whole, split) -> None:  # type: ignore[no-untyped-def]
    """A session run as [0,3) then [3,6) through one 0:6 block equals the 0:2/2:4/4:6 split."""
    whole.open_session("s", 20)
    for block in split:
        block.open_session("s", 20)
    hidden = head.embed(torch.tensor(PROMPT))
    mid = whole.forward([Step("s", hidden, 0, 3, 0)])[0]
    assert whole.session_length("s", 2) == len(PROMPT) and whole.session_length("s", 3) == 0
    got = whole.forward([Step("s", mid, 3, 6, 0)])[0]
    expected = _through(split, hidden, "s", 0)
    assert (got - expected).abs().max().item() <= 1e-5
    # a decode step, again split at a different layer
    token = head.embed(torch.tensor([int(head.logits(got[-1]).argmax())]))
    mid = whole.forward([Step("s", token, 0, 4, len(PROMPT))])[0]
    got = whole.forward([Step("s", mid, 4, 6, len(PROMPT))])[0]
    assert (got - _through(split, token, "s", len(PROMPT))).abs().max().item() <= 1e-5


def test_replay_from_an_earlier_position_truncates_the_cache(head, whole) -> None:  # type: ignore[no-untyped-def]
    whole.open_session("s", 32)
    hidden = head.embed(torch.tensor(PROMPT))
    first = whole.forward([Step("s", hidden, 0, 6, 0)])[0]
    extra = head.embed(torch.tensor([1, 2, 3]))
    after = whole.forward([Step("s", extra, 0, 6, len(PROMPT))])[0]
    # retry the same step (idempotent), then replay everything from scratch
    again = whole.forward([Step("s", extra, 0, 6, len(PROMPT))])[0]
    assert torch.equal(after, again)
    replay = whole.forward([Step("s", hidden, 0, 6, 0)])[0]
    assert (replay - first).abs().max().item() <= 1e-6
    assert whole.session_length("s", 0) == len(PROMPT)
    with pytest.raises(SessionError, match="holds only"):
        whole.forward([Step("s", extra, 0, 6, len(PROMPT) + 1)])


def test_sessions_take_cache_blocks_as_their_tokens_come(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    """Opening takes nothing; each step takes whole blocks of 16 tokens for the tokens it brings; a rewind
    gives back the blocks past it; closing gives back the rest. max_length_tokens only bounds a session."""
    block = tiny_source.load_blocks(0, 2, cache_tokens=100)  # 6 blocks of 16: 96 tokens
    assert block.cache.cache_tokens == 96 and block.free_cache_tokens == 96
    block.open_session("a", 96)
    block.open_session("b", 96)  # each may grow to all of it: a promise, not a reservation
    assert block.cache.free_tokens == 96 and block.active_sessions == ["a", "b"]
    block.forward([Step("a", head.embed(torch.tensor(PROMPT * 2)), 0, 2, 0)])  # 18 tokens: 2 blocks
    assert block.cache.free_tokens == 64 and block.cache.get("a").held_tokens == 32
    block.forward([Step("a", head.embed(torch.tensor([1])), 0, 2, 5)])  # a rewind to position 5
    assert block.cache.free_tokens == 80 and block.session_length("a", 0) == 6
    with pytest.raises(CapacityError, match="holds 96"):
        block.open_session("c", 97)
    block.close_session("a")
    assert block.cache.free_tokens == 96 and block.active_sessions == ["b"]
    with pytest.raises(SessionError):
        block.close_session("a")
    with pytest.raises(SessionError, match="already open"):
        block.open_session("b", 1)


def test_bad_steps_raise_clear_errors(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    block = tiny_source.load_blocks(2, 4, cache_tokens=100)
    block.open_session("s", 4)
    good = head.embed(torch.tensor([1, 2]))
    with pytest.raises(ProtocolError, match="hidden size"):
        block.forward([Step("s", torch.zeros(2, 65), 2, 4, 0)])
    with pytest.raises(ProtocolError, match="dtype"):
        block.forward([Step("s", good.double(), 2, 4, 0)])
    with pytest.raises(ProtocolError, match="T >= 1"):
        block.forward([Step("s", good[None], 2, 4, 0)])
    with pytest.raises(ProtocolError, match="not inside"):
        block.forward([Step("s", good, 1, 4, 0)])
    with pytest.raises(ProtocolError, match="not inside"):
        block.forward([Step("s", good, 3, 3, 0)])
    with pytest.raises(SessionError, match="unknown session"):
        block.forward([Step("nope", good, 2, 4, 0)])
    with pytest.raises(ProtocolError, match="max length"):
        block.forward([Step("s", head.embed(torch.tensor([1, 2, 3, 4, 5])), 2, 4, 0)])
    with pytest.raises(ProtocolError, match="twice"):
        block.forward([Step("s", good, 2, 4, 0), Step("s", good, 2, 4, 0)])
    with pytest.raises(ProtocolError, match="stateless"):
        block.forward([Step(None, good, 2, 4, 3)])
    assert block.session_length("s", 2) == 0  # failed calls changed nothing


def test_bad_load_arguments(tiny_source) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="invalid layer range"):
        tiny_source.load_blocks(3, 3)
    with pytest.raises(ValueError, match="past the last layer"):
        tiny_source.load_blocks(4, 8)
    with pytest.raises(ValueError, match="unknown dtype"):
        tiny_source.load_blocks(0, 2, dtype="int8")
    with pytest.raises(ValueError, match="unknown device"):
        tiny_source.load_head(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device .cuda.: torch .* (is a CPU build|finds no usable GPU)"):
            tiny_source.load_blocks(0, 2, device="cuda")


def test_bfloat16_blocks_run_close_to_float32(tiny_source, head) -> None:  # type: ignore[no-untyped-def]
    block = tiny_source.load_blocks(0, 6, dtype="bfloat16")
    hidden = head.embed(torch.tensor(PROMPT))
    low = block.forward([Step(None, hidden.bfloat16(), 0, 6, 0)])[0]
    full = tiny_source.load_blocks(0, 6).forward([Step(None, hidden, 0, 6, 0)])[0]
    assert low.dtype == torch.bfloat16
    assert (low.float() - full).abs().max().item() <= 0.1 * full.abs().max().item()


@pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed weights")
def test_packed_copies_are_timed_and_kept_only_within_the_memory_given(tiny_source, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    asked: list[bool] = []

    def faster_when_packed(weights: list[torch.Tensor], *, packing: bool = False) -> Forms:
        asked.append(packing)
        return Forms(packer=packers()[0], packed_rows=frozenset({3})) if packing else PLAIN

    monkeypatch.setattr(cpu_range, "calibrate", faster_when_packed)
    weight_bytes = 2 * sum(
        p.numel() * 4 for p in tiny_source.load_blocks(0, 1).layers.parameters() if p.ndim == 2
    )
    tight = tiny_source.load_blocks(0, 2, cache_tokens=100, pack_bytes=weight_bytes - 1)
    roomy = tiny_source.load_blocks(0, 2, cache_tokens=100, pack_bytes=weight_bytes)
    assert asked[-2:] == [False, True]  # a copy it cannot afford is not even timed
    assert tight.kernels._packed == {} and tight.kernels.forms == PLAIN
    assert len(roomy.kernels._packed) == 2 * 7 and roomy.kernels.forms.packed_rows == {
        3
    }  # 7 projections a layer
    bf16 = tiny_source.load_blocks(0, 2, dtype="bfloat16", cache_tokens=100, pack_bytes=2**40)
    assert type(bf16.kernels) is TorchRange  # packed weights are float32 only: plain torch for bfloat16


def test_between_layers_is_called_before_each_layer_after_the_first_and_changes_nothing(tiny_source) -> None:  # type: ignore[no-untyped-def]
    """A session step's forward over layers [1, 5) calls ``between_layers`` 3 times, each time once the layer
    before it has written its cache, and outputs exactly what a forward without it does."""
    hidden = torch.randn(6, tiny_source.spec.hidden_size, generator=torch.Generator().manual_seed(8))
    outputs, seen = [], []
    for hook in (False, True):
        blocks = tiny_source.load_blocks(0, 6, cache_tokens=100)
        blocks.open_session("s", 16)

        def between_layers(blocks=blocks) -> None:  # type: ignore[no-untyped-def]
            seen.append([blocks.session_length("s", layer) for layer in range(1, 5)])

        outputs.append(blocks.forward([Step("s", hidden, 1, 5, 0)], between_layers if hook else None)[0])
    assert seen == [[6, 0, 0, 0], [6, 6, 0, 0], [6, 6, 6, 0]]
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)
