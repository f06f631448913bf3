"""swarm.models.backends.cpu.int4: exactly 4-bit weights found bit for bit, multiplied to F.linear's result, and greedy tokens
through 4-bit blocks equal to transformers' on a model whose weights are 4-bit."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from client.local import in_process_client
from swarm.models import SamplingParams, Step
from swarm.models.backends.cpu import int4, matmul
from swarm.models.backends.cpu.held import Int4Linear, hold
from swarm.models.backends.cpu.matmul import PACKED_TIMED_ROWS, Forms, NotFourBit, pack, taken
from swarm.models.kv_cache import Slot
from swarm.testing.weights import four_bit, make_four_bit

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not int4.available(), reason="no 4-bit kernel here (needs x86-64 AVX2 and a C compiler)"
    ),
]

BUILDS = {"avx2": int4.FLAGS, "avx512": int4.FLAGS + int4.AVX512_FLAGS}  # int4.c with and without table_rows


@pytest.fixture(params=sorted(BUILDS))
def build(request: pytest.FixtureRequest) -> Any:
    """The kernel compiled as on a machine with AVX2 only, and as on one with AVX-512 (where this one has it)."""
    if request.param == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("no AVX-512 here")
    with int4.built_with(BUILDS[request.param]):
        yield request.param


EVERY_ROW_COUNT = Forms(packer="int4", packed_rows=frozenset(PACKED_TIMED_ROWS), packed_beyond=True)
PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300]


def _weight(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    return four_bit(torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 0.05)


@pytest.mark.parametrize("shape", [(96, 64), (7, 32), (1, 1536), (200, 96)])
def test_the_kernel_widens_every_weight_to_exactly_the_float32_weight(
    shape: tuple[int, int], build: str
) -> None:
    """One-hot rows pick out single weights: the product is each widened weight itself, bit for bit, in calls
    of 1 to 13 rows (passes of every size, up to 6 rows widened by the AVX-512 build's table)."""
    weight = _weight(*shape)
    packed = int4.unpack(weight)
    assert packed is not None and packed.shape == (shape[0], int4.row_bytes(shape[1]))
    columns = shape[1]
    sizes = itertools.accumulate(itertools.cycle(range(1, 14)), initial=0)  # calls of 1, 2, .. 13 rows
    starts = [*itertools.takewhile(lambda start: start < columns, sizes), columns]
    picked = torch.cat(
        [int4.product(torch.eye(columns)[a:b], packed, shape[0]) for a, b in itertools.pairwise(starts)]
    )
    assert torch.equal(picked, weight.T)


@pytest.mark.parametrize(
    "rows, columns",
    [(r, 128) for r in (0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64)]
    + [(r, 1536) for r in (5, 6, 7, 8, 13)],  # wide inputs: passes of fewer rows (int4.c's L1_INPUT_BYTES)
)
def test_products_are_f_linears_for_every_row_count(rows: int, columns: int, build: str) -> None:
    weight = _weight(96, columns, seed=rows)
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows + 1))
    packed = int4.unpack(weight)
    assert packed is not None
    got = int4.product(x, packed, 96)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        int4.product(x.T.contiguous().T, packed, 96), got, atol=0, rtol=0
    )  # any layout


@pytest.mark.parametrize("shape", [(96, 64), (7, 32), (3, 1536)])
def test_widened_weights_are_the_float32_weights_bit_for_bit(shape: tuple[int, int], build: str) -> None:
    """What a range holding 4-bit weights multiplies by where F.linear is faster: exactly the loaded weights."""
    weight = _weight(*shape)
    packed = int4.unpack(weight)
    assert packed is not None
    out = torch.full((shape[0] * shape[1],), float("nan"))
    int4.widen(packed, *shape, out)
    assert torch.equal(out.view(shape), weight)
    with pytest.raises(ValueError, match="cannot widen"):
        int4.widen(packed, shape[0], shape[1], torch.empty(shape[0] * shape[1] - 1))


def test_a_layer_held_as_4_bit_gives_the_float32_layers_products(tiny_source) -> None:  # type: ignore[no-untyped-def]
    """held.hold replaces each exactly 4-bit projection by an Int4Linear (q, k, v and gate, up packed together,
    each a view of one tensor), which widens back to the same weight and multiplies to F.linear's result."""
    layer = tiny_source.load_blocks(0, 1).layers[0]
    make_four_bit(layer)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    owners = {
        n: layer.self_attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
        for n in names
    }
    weights = {n: getattr(owners[n], n).weight.detach().clone() for n in names}
    hold(layer)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))  # as wide as the widest input
    for name in names:
        held = getattr(owners[name], name)
        assert isinstance(held, Int4Linear) and torch.equal(held.widened(), weights[name])
        torch.testing.assert_close(
            held(x[:, : held.in_features]), F.linear(x[:, : held.in_features], weights[name])
        )
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.together is attn.k_proj.together is attn.v_proj.together is not None
    assert mlp.gate_proj.together is mlp.up_proj.together is not None and attn.o_proj.together is None


def test_weights_that_are_not_exactly_4_bit_are_left_alone() -> None:
    weight = _weight(16, 64)
    assert int4.unpack(weight) is not None
    nudged = weight.clone()
    nudged[3, 40] = torch.nextafter(nudged[3, 40], torch.tensor(1.0))  # one weight one float32 step off
    assert int4.unpack(nudged) is None
    assert int4.unpack(torch.randn(16, 64)) is None  # plain float32
    assert int4.unpack(_weight(16, 64)[:, :48]) is None  # rows not whole blocks
    assert int4.unpack(weight.double()) is None
    assert int4.unpack(weight.bfloat16()) is None
    assert int4.unpack(torch.full((4, 32), float("nan"))) is None
    constant = torch.full((4, 32), 0.25)  # d = 0: every weight is the block's minimum
    assert int4.unpack(constant) is not None
    with pytest.raises(NotFourBit, match="not exactly 4-bit"):
        pack(torch.randn(16, 64), "int4")


def test_packed_weights_that_do_not_fit_the_input_are_refused() -> None:
    packed = int4.unpack(_weight(16, 64))
    assert packed is not None
    with pytest.raises(ValueError, match="do not fit"):
        int4.product(torch.randn(2, 96), packed, 16)
    with pytest.raises(ValueError, match="do not fit"):
        int4.product(torch.randn(2, 64), packed, 8)
    with pytest.raises(ValueError, match="do not fit"):
        int4.product(torch.randn(2, 65), packed, 16)  # the same packed row length, but not whole blocks
    for rows in (torch.randn(2, 64, dtype=torch.float64), torch.randn(64), torch.randn(1, 2, 64)):
        with pytest.raises(ValueError, match="CPU float32 rows"):
            int4.product(rows, packed, 16)


def test_calibration_offers_the_4_bit_form_only_for_4_bit_weights() -> None:
    assert "int4" in matmul._offered([_weight(64, 64), _weight(32, 128)])
    assert "int4" not in matmul._offered([_weight(64, 64), torch.randn(32, 128)])
    # forms calibrated on 4-bit weights of these shapes, taken by weights that are not 4-bit: F.linear
    forms, copies = taken(EVERY_ROW_COUNT, [_weight(64, 64), torch.randn(64, 64)])
    assert forms == Forms() and copies == {}


@pytest.fixture(scope="module")
def four_bit_model(tiny_source):  # type: ignore[no-untyped-def]
    """The tiny Llama with 4-bit weights: transformers' model, and our ranges of it taking the 4-bit form."""
    reference = tiny_source.load_reference_model()
    make_four_bit(reference.model.layers)  # the decoder layers: the head stays as the client loads it
    blocks = []
    for start, end in [(0, 2), (2, 4), (4, 6)]:
        block = tiny_source.load_blocks(start, end, cache_tokens=1000)
        make_four_bit(block.layers)
        block.kernels.use_forms(EVERY_ROW_COUNT)
        assert block.kernels.forms == EVERY_ROW_COUNT
        # held as 4-bit in place of float32: every weight of theirs is 4-bit
        assert not any(isinstance(m, torch.nn.Linear) for m in block.layers.modules())
        blocks.append(block)
    return reference, blocks


def test_greedy_generation_through_4_bit_blocks_matches_transformers(tiny_source, four_bit_model) -> None:  # type: ignore[no-untyped-def]
    reference, blocks = four_bit_model
    reference.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])
    expected = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
    )
    client = in_process_client(tiny_source.load_head(), {f"peer-{i}": b for i, b in enumerate(blocks)})
    assert (
        asyncio.run(client.generate_ids(PROMPT, 32, SamplingParams())) == expected[0, len(PROMPT) :].tolist()
    )


def test_batched_4_bit_decode_steps_equal_the_same_steps_alone(  # type: ignore[no-untyped-def]
    tiny_source, four_bit_model, build
) -> None:
    """Sessions decoding together go through the kernel's multi-row passes (up to 8 rows, then 8 more)."""
    _, blocks = four_bit_model
    block, head = blocks[0], tiny_source.load_head()
    sessions = [f"s{i}" for i in range(11)]
    for i, session in enumerate(sessions):
        block.open_session(session, 20)
        block.forward([Step(session, head.embed(torch.tensor(PROMPT[: i % 5 + 2])), 0, 2, 0)])
    tokens = {s: torch.tensor([PROMPT[i % len(PROMPT)]]) for i, s in enumerate(sessions)}
    together = block.forward(
        [Step(s, head.embed(tokens[s]), 0, 2, i % 5 + 2) for i, s in enumerate(sessions)]
    )
    for i, session in enumerate(sessions):  # the same step again: a replay from that position
        alone = block.forward([Step(session, head.embed(tokens[session]), 0, 2, i % 5 + 2)])[0]
        torch.testing.assert_close(alone, together[i], atol=1e-5, rtol=1e-5)
    for session in sessions:
        block.close_session(session)


def test_projections_packed_together_are_each_projection_bit_for_bit_and_add_no_memory(
    tiny_source, four_bit_model
) -> None:  # type: ignore[no-untyped-def]
    """q, k, v (and the MLP's gate and up) go through one product of their packed rows one after another."""
    _, blocks = four_bit_model
    block, head = blocks[1], tiny_source.load_head()
    layer = block.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        together = block.kernels._together[id(group[0])]
        start = together.data_ptr()
        for projection in group:  # the copies kept of each are views of the one kept together
            packed = projection.packed
            assert start <= packed.data_ptr() < start + together.numel()
    sessions = ["a", "b", "c"]
    outputs = []
    for together in (dict(block.kernels._together), {}):  # packed together, then one product each
        block.kernels._together = together
        for i, session in enumerate(sessions):
            block.open_session(session, 20)
            steps = [Step(session, head.embed(torch.tensor(PROMPT[: i + 2])), 2, 4, 0)]
            outputs.append(block.forward(steps)[0])
        outputs.extend(
            block.forward(
                [
                    Step(s, head.embed(torch.tensor(PROMPT[i : i + 1])), 2, 4, i + 2)
                    for i, s in enumerate(sessions)
                ]
            )
        )
        for session in sessions:
            block.close_session(session)
    half = len(outputs) // 2
    for fused, apart in zip(outputs[:half], outputs[half:], strict=True):
        assert torch.equal(fused, apart)


def test_steps_through_the_fused_layer_equal_the_layer_written_out(
    tiny_source, four_bit_model, monkeypatch, build
) -> None:  # type: ignore[no-untyped-def]
    """int4.decode_layers runs whole layers for steps of few tokens: the same as _layer's torch operations to
    float rounding, outputs and caches alike, for prompts (a step's tokens attend causally to each other),
    decode steps and steps of 2 or 3 tokens batched together, sessions of different lengths growing past
    their first cache capacity, in any order."""
    _, blocks = four_bit_model
    block, head = blocks[2], tiny_source.load_head()
    fused = list(block.kernels._fused)
    assert all(weights is not None for weights in fused)
    calls: list[tuple[int, int]] = []  # (rows, layers) of each call
    real = int4.decode_layers

    def counted(*args: Any) -> None:
        calls.append((len(args[0]), len(args[1].layers)))
        real(*args)

    monkeypatch.setattr(int4, "decode_layers", counted)
    sessions = [f"f{i}" for i in range(9)]
    lengths = {s: 1 + 5 * i for i, s in enumerate(sessions)}
    results = {}
    for mode, layers in (("fused", fused), ("written out", [None] * len(fused))):
        block.kernels._fused = layers
        rng = torch.Generator().manual_seed(3)
        outputs = []
        for session in sessions:
            block.open_session(session, 110)  # 9 of them in the fixture's 1000 cache tokens
            prompt = torch.tensor([PROMPT[j % len(PROMPT)] for j in range(lengths[session])])
            outputs.extend(block.forward([Step(session, head.embed(prompt), 4, 6, 0)]))
        order = torch.Generator().manual_seed(5)
        for step in range(30):  # past the caches' first capacity
            batch = [sessions[i] for i in torch.randperm(len(sessions), generator=order)[: 1 + step % 9]]
            sizes = [1 + (step + i) % 3 if step % 3 == 0 else 1 for i in range(len(batch))]
            steps = []
            for session, size in zip(batch, sizes, strict=True):
                hidden = torch.randn(size, tiny_source.spec.hidden_size, generator=rng)
                steps.append(Step(session, hidden, 4, 6, block.session_length(session, 4)))
            outputs.append(torch.cat(block.forward(steps)))
        caches = {s: block.cache.get(s) for s in sessions}
        results[mode] = (
            outputs,
            {s: [c.gather(4 + i, c.lengths[i]) for i in range(2)] for s, c in caches.items()},
            {s: list(c.lengths) for s, c in caches.items()},
        )
        for session in sessions:
            block.close_session(session)
    block.kernels._fused = fused
    # 9 prompts + 30 steps, each one call of both layers, then none while written out
    assert len(calls) == 39 and {layers for _, layers in calls} == {2}
    assert max(rows for rows, _ in calls) == max(lengths.values())
    (fused_out, fused_kv, fused_lengths), (plain_out, plain_kv, plain_lengths) = (
        results["fused"],
        results["written out"],
    )
    assert fused_lengths == plain_lengths
    for a, b in zip(fused_out, plain_out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for session in sessions:
        for (k1, v1), (k2, v2) in zip(fused_kv[session], plain_kv[session], strict=True):
            torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)


def test_a_range_in_one_call_is_bit_for_bit_its_layers_called_one_by_one(
    tiny_source, four_bit_model, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A decode call runs its whole range in one int4.decode_layers call; a prefill that gives way between
    layers calls int4.decode_layers per layer. Both give the same outputs and caches, bit for bit; and a range
    whose layers were replaced is gathered again, not run on the old weights."""
    _, blocks = four_bit_model
    block, head = blocks[2], tiny_source.load_head()
    between: list[int] = []
    results: list[tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]] = []
    whole_range: list[int] = []  # layers of each decode_layers call of the pass that never gives way
    real = int4.decode_layers

    def counted(*args: Any) -> None:
        if not results:
            whole_range.append(len(args[1].layers))
        real(*args)

    monkeypatch.setattr(int4, "decode_layers", counted)
    for gives_way in (None, lambda: between.append(1)):
        rng = torch.Generator().manual_seed(11)
        outputs = []
        for i in range(3):
            block.open_session(f"r{i}", 64)
            prompt = head.embed(torch.tensor(PROMPT[: 3 + i]))
            outputs.extend(block.forward([Step(f"r{i}", prompt, 4, 6, 0)], gives_way))
        for k in range(5):
            steps = [
                Step(f"r{i}", torch.randn(1, tiny_source.spec.hidden_size, generator=rng), 4, 6, 3 + i + k)
                for i in range(3)
            ]
            outputs.extend(block.forward(steps, gives_way))
        caches = [block.cache.get(f"r{i}") for i in range(3)]
        kv = [c.gather(4 + j, c.lengths[j]) for c in caches for j in range(2)]
        results.append((outputs, kv))
        for i in range(3):
            block.close_session(f"r{i}")
    assert len(between) == 3 + 5  # once between the two layers of each call
    assert whole_range == [2] * (3 + 5)  # and before: each call both layers at once
    (one_call, one_kv), (by_layer, by_layer_kv) = results
    assert all(torch.equal(a, b) for a, b in zip(one_call, by_layer, strict=True))
    assert all(
        torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(one_kv, by_layer_kv, strict=True)
    )
    gathered = block.kernels._layer_run(4, 6)
    assert block.kernels._layer_run(4, 6) is gathered
    fused = list(block.kernels._fused)
    block.kernels._fused = [dataclasses.replace(w) for w in fused]  # the same tensors in new objects
    try:
        assert block.kernels._layer_run(4, 6) is not gathered and block.kernels._layer_run(4, 6).of(
            block.kernels._fused[4 - block.range.start : 6 - block.range.start]
        )
    finally:
        block.kernels._fused = fused


def _zero_layer(hidden: int = 64, heads: int = 2, kv_heads: int = 1, head_dim: int = 32) -> int4.LayerWeights:
    """A layer of the shapes decode_layers reads (all weights zero)."""
    q_width, qkv_rows, intermediate = heads * head_dim, (heads + 2 * kv_heads) * head_dim, hidden

    def packed(rows: int, columns: int) -> torch.Tensor:
        return torch.zeros(rows, int4.row_bytes(columns), dtype=torch.uint8)

    return int4.LayerWeights(
        torch.zeros(hidden),
        torch.zeros(hidden),
        1e-5,
        packed(qkv_rows, hidden),
        packed(hidden, q_width),
        packed(2 * intermediate, hidden),
        packed(hidden, intermediate),
        intermediate,
    )


def test_the_fused_layer_refuses_a_cache_without_room_for_the_token() -> None:
    attention = int4.Attention(heads=2, kv_heads=1, head_dim=32, scale=0.2)
    h = torch.zeros(1, 64)
    full = torch.zeros(1, 4, 32)
    weights = _zero_layer()
    angles = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="cannot take token 4"):
        int4.decode_layers(h, int4.LayerRun([weights]), attention, angles, angles, [[(full, full, 4)]])
    with pytest.raises(ValueError, match="N caches"):
        int4.decode_layers(h, int4.LayerRun([weights]), attention, angles, angles, [[]])
    run = int4.LayerRun([weights, weights])
    with pytest.raises(ValueError, match="N caches"):  # a layer's caches missing
        int4.decode_layers(h, run, attention, angles, angles, [[(full, full, 0)]])
    with pytest.raises(ValueError, match="of the run's size"):  # rows of another width than the weights'
        int4.decode_layers(torch.zeros(1, 96), run, attention, angles, angles, [[(full, full, 0)]] * 2)
    with pytest.raises(ValueError, match="of the run's size"):  # heads the weights do not have
        other = int4.Attention(heads=4, kv_heads=1, head_dim=32, scale=0.2)
        int4.decode_layers(h, run, other, angles, angles, [[(full, full, 0)]] * 2)
    int4.decode_layers(h, run, attention, angles, angles, [[(full, full, 0)]] * 2)  # all of the right sizes


@pytest.mark.parametrize(
    "change",
    [
        lambda w: dataclasses.replace(w, intermediate=32),
        lambda w: dataclasses.replace(w, down=w.down[:, :-8]),
        lambda w: dataclasses.replace(w, qkv=w.qkv[:-1]),
        lambda w: dataclasses.replace(w, norm_post=torch.zeros(63)),
        lambda w: dataclasses.replace(w, o=w.o.T.contiguous().T),
        lambda w: dataclasses.replace(w, gate_up=w.gate_up.float()),
    ],
    ids=["MLP width", "down columns", "qkv rows", "norm size", "not contiguous", "dtype"],
)
def test_a_run_refuses_layers_whose_weights_the_kernel_would_read_past(
    change: Callable[[int4.LayerWeights], int4.LayerWeights],
) -> None:
    weights = _zero_layer()
    with pytest.raises(ValueError, match="as the run's first layer has it"):
        int4.LayerRun([weights, change(weights)])


def test_a_run_is_not_taken_for_layers_whose_tensors_moved() -> None:
    """The run holds addresses: a weight given other memory (``.data =``) makes it another run."""
    weights = _zero_layer()
    run = int4.LayerRun([weights])
    assert run.of([weights]) and not run.of([_zero_layer()])
    weights.norm_in.data = weights.norm_in.data.clone()
    assert not run.of([weights])


def test_a_failed_fused_call_leaves_the_caches_as_before_the_step(
    tiny_source, four_bit_model, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Every layer of the range is reserved before the call: if the call fails (the kernel's scratch memory, say)
    the tokens not written must not count as cached, in one call or a layer at a time; the step then runs again
    from the same position and gives what it would have."""
    _, blocks = four_bit_model
    block, head = blocks[2], tiny_source.load_head()
    block.open_session("fails", 32)
    try:
        block.forward([Step("fails", head.embed(torch.tensor(PROMPT[:4])), 4, 6, 0)])
        step = Step("fails", head.embed(torch.tensor([PROMPT[4]])), 4, 6, 4)
        real = int4.decode_layers
        for gives_way, fail_at in ((None, 1), (lambda: None, 2)):  # one call; the second layer's call
            calls = [0]

            def failing(*args: Any, fail_at: int = fail_at, calls: list[int] = calls) -> None:
                calls[0] += 1
                if calls[0] == fail_at:
                    raise MemoryError("decode_layers could not allocate its scratch memory")
                real(*args)

            monkeypatch.setattr(int4, "decode_layers", failing)
            with pytest.raises(MemoryError):
                block.forward([step], gives_way)
            assert [block.session_length("fails", layer) for layer in (4, 5)] == [4, 4]
        monkeypatch.setattr(int4, "decode_layers", real)
        again = block.forward([step])[0]
        assert [block.session_length("fails", layer) for layer in (4, 5)] == [5, 5]
        assert torch.equal(block.forward([step])[0], again)  # the same step replayed from position 4
    finally:
        block.close_session("fails")


def test_a_product_of_no_columns_is_zeros() -> None:
    """Rows of no features (K = 0) give zeros, as F.linear does, rather than a division by zero in the kernel."""
    assert torch.equal(
        int4.product(torch.zeros(2, 0), torch.empty(3, 0, dtype=torch.uint8), 3), torch.zeros(2, 3)
    )


@pytest.mark.parametrize("head_dim", [12, 16, 72, 100])
@pytest.mark.parametrize("cached", [0, 7, 8, 33])
def test_the_fused_layers_attention_is_the_attention_written_out(head_dim: int, cached: int) -> None:
    """Attention of one decode token over its cache, for head sizes the kernel takes in its several ways (64
    elements of a head at a time, then 8, then one): with the MLP's weights zero the layer adds just o(attention),
    which torch computes here from the same widened weights."""
    heads, kv_heads, hidden = 8, 2, 64
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    generator = torch.Generator().manual_seed(head_dim * 100 + cached)
    qkv, o = _weight(q_width + 2 * kv_width, hidden, seed=head_dim), _weight(hidden, q_width, seed=cached)
    zero = _zero_layer(hidden, heads, kv_heads, head_dim)
    norm_in = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    packed_qkv, packed_o = int4.unpack(qkv), int4.unpack(o)
    assert packed_qkv is not None and packed_o is not None
    weights = dataclasses.replace(zero, norm_in=norm_in, qkv=packed_qkv, o=packed_o)
    attention = int4.Attention(heads, kv_heads, head_dim, scale=head_dim**-0.5)
    h = torch.randn(1, hidden, generator=generator)
    keys = torch.randn(kv_heads, cached + 3, head_dim, generator=generator)
    values = torch.randn(kv_heads, cached + 3, head_dim, generator=generator)
    angles = torch.rand(1, head_dim // 2, generator=generator).repeat(1, 2) * 6
    cos, sin = angles.cos(), angles.sin()

    def rotated(x: torch.Tensor) -> torch.Tensor:  # [n, head_dim]
        return x * cos + torch.cat((-x[:, head_dim // 2 :], x[:, : head_dim // 2]), dim=1) * sin

    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + zero.eps) * norm_in
    q, k, v = F.linear(x, qkv).split([q_width, kv_width, kv_width], dim=1)
    k_all = torch.cat((keys[:, :cached], rotated(k.view(kv_heads, head_dim)).unsqueeze(1)), dim=1)
    v_all = torch.cat((values[:, :cached], v.view(kv_heads, 1, head_dim)), dim=1)
    group = heads // kv_heads
    q_heads = rotated(q.view(heads, head_dim)).view(kv_heads, group, head_dim)
    # [kv_heads, group, cached + 1]
    scores = torch.softmax(q_heads @ k_all.transpose(1, 2) * attention.scale, dim=-1)
    expected = h + F.linear((scores @ v_all).reshape(1, q_width), o)

    out = h.clone()
    int4.decode_layers(out, int4.LayerRun([weights]), attention, cos, sin, [[(keys, values, cached)]])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys[:, : cached + 1], k_all)  # the token's key and value went into the cache
    torch.testing.assert_close(values[:, : cached + 1], v_all)


def test_a_build_is_named_by_its_flags_and_kept_apart() -> None:
    """built_with switches this module's kernels to another build and back: measurements kept for one build
    (swarm.models.backends.cpu.matmul's forms, by kernel_version) are not taken for another."""
    here = int4.kernel_version()
    with int4.built_with(int4.FLAGS):
        avx2 = int4.kernel_version()
        assert int4.available()
        with int4.built_with(int4.FLAGS + int4.AVX512_FLAGS):
            assert int4.kernel_version() != avx2
        assert int4.kernel_version() == avx2
    assert int4.kernel_version() == here


def test_a_build_the_compiler_refuses_leaves_the_avx2_build() -> None:
    """Where the compiler refuses this machine's flags (an AVX-512 option it does not know), the kernel is the
    AVX2 build, named as that build: the 4-bit form is not lost."""
    with int4.built_with(int4.FLAGS):
        avx2 = int4.kernel_version()
    with int4.built_with((*int4.FLAGS, "-mno-such-option-anywhere")):
        assert int4.available()
        assert int4.kernel_version() == avx2
        weight = _weight(8, 64)
        packed = int4.unpack(weight)
        assert packed is not None
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(int4.product(x, packed, 8), F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [12, 32, 72])
@pytest.mark.parametrize("cached", [0, 15, 16, 40])
def test_attention_through_a_block_table_is_bit_for_bit_the_contiguous_cache(
    head_dim: int, cached: int
) -> None:
    """A session's cache in blocks of a pool, out of order (kv_cache's layout), gives the same output and
    writes the same key and value as the same tokens in one contiguous cache, bit for bit."""
    heads, kv_heads, hidden, block = 8, 2, 64, 16
    generator = torch.Generator().manual_seed(head_dim + cached)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    packed_qkv = int4.unpack(_weight(q_width + 2 * kv_width, hidden, seed=head_dim))
    packed_o = int4.unpack(_weight(hidden, q_width, seed=cached + 1))
    assert packed_qkv is not None and packed_o is not None
    zero = _zero_layer(hidden, heads, kv_heads, head_dim)
    weights = dataclasses.replace(zero, norm_in=torch.ones(hidden), qkv=packed_qkv, o=packed_o)
    attention = int4.Attention(heads, kv_heads, head_dim, scale=head_dim**-0.5)
    h = torch.randn(1, hidden, generator=generator)
    angles = torch.rand(1, head_dim, generator=generator)
    capacity = (cached // block + 1) * block
    keys = torch.randn(kv_heads, capacity, head_dim, generator=generator)
    values = torch.randn(kv_heads, capacity, head_dim, generator=generator)
    # the same tokens in a pool of 7 blocks, the session's blocks scattered in it
    table = torch.tensor([5, 1, 6, 0, 3][: capacity // block], dtype=torch.int64)
    pool_keys = torch.randn(kv_heads, 7, block, head_dim, generator=generator)
    pool_values = torch.randn(kv_heads, 7, block, head_dim, generator=generator)
    pool_keys[:, table] = keys.view(kv_heads, -1, block, head_dim)
    pool_values[:, table] = values.view(kv_heads, -1, block, head_dim)
    run = int4.LayerRun([weights])
    contiguous, paged = h.clone(), h.clone()
    int4.decode_layers(contiguous, run, attention, angles.cos(), angles.sin(), [[(keys, values, cached)]])
    slot = Slot(pool_keys, pool_values, table, cached)
    int4.decode_layers(paged, run, attention, angles.cos(), angles.sin(), [[slot]])
    assert torch.equal(paged, contiguous)
    written = pool_keys[:, table].reshape(kv_heads, capacity, head_dim)
    assert torch.equal(written[:, : cached + 1], keys[:, : cached + 1])
    assert torch.equal(pool_values[:, table].reshape(kv_heads, capacity, head_dim), values)
    with pytest.raises(ValueError, match="cannot take token"):  # a table without room for the token
        int4.decode_layers(
            paged,
            run,
            attention,
            angles.cos(),
            angles.sin(),
            [[Slot(pool_keys, pool_values, table, capacity)]],
        )
