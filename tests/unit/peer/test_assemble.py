"""A range a peer moves to, or loads under a small memory budget, runs the form a range loaded at join runs:
its exactly 4-bit weights held as 4-bit (no float32 copy), decode steps through the fused 4-bit kernel, the
same outputs; and the memory a peer counts per layer is what it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from swarm.models import ModelSource, Step
from swarm.models.backends.cpu import int4
from swarm.models.backends.cpu.held import Int4Linear
from swarm.models.checkpoints import write_tiny_checkpoint
from swarm.peer.follow import assemble_blocks
from swarm.peer.measure import max_layers_within, packing_bytes
from swarm.testing.weights import four_bit
from swarm.types import LayerRange

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not int4.available(), reason="no 4-bit kernel here (needs x86-64 AVX2 and a C compiler)"
    ),
]


ROWS = [*range(1, 17), 64]  # a decode call's rows, and a prefill chunk's


@pytest.fixture(scope="module")
def four_bit_source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    """The tiny Llama with every decoder projection exactly 4-bit, as a GGUF Q4_1 checkpoint widens them."""
    path: Path = tmp_path_factory.mktemp("tiny-4bit")
    write_tiny_checkpoint(path, seed=3)
    state = load_file(str(path / "model.safetensors"))
    for name, tensor in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            state[name] = four_bit(tensor).contiguous()
    save_file(state, str(path / "model.safetensors"), {"format": "pt"})
    return ModelSource(path)


def _decode(blocks, hidden: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """A 5-token prompt, then 3 decode steps, of one session through the whole range."""
    start, end = blocks.range.start, blocks.range.end
    blocks.open_session("s", 16)
    try:
        outputs = blocks.forward([Step("s", hidden[:5], start, end, 0)])
        for position in (5, 6, 7):
            outputs += blocks.forward([Step("s", hidden[position : position + 1], start, end, position)])
        return outputs
    finally:
        blocks.close_session("s")


def test_a_moved_or_budgeted_range_runs_the_form_of_one_loaded_at_join(four_bit_source: ModelSource) -> None:
    source = four_bit_source
    spec = source.spec
    joined = source.load_blocks(0, 4, cache_tokens=64, pack_bytes=2**40)
    held = source.load_blocks(1, 3, cache_tokens=64)  # what the peer held before moving: 1:3 -> 0:4
    moved = assemble_blocks(source, held, LayerRange(0, 4))
    budgeted = source.load_blocks(0, 4, cache_tokens=64, pack_bytes=0)  # nothing to spare beside the weights
    narrowed = assemble_blocks(source, joined, LayerRange(1, 3))  # 0:4 -> 1:3, no load
    per_layer = source.held_layer_bytes()
    for blocks in (joined, moved, budgeted, narrowed):
        modules = list(blocks.layers.modules())
        assert not any(isinstance(m, nn.Linear) for m in modules)  # no float32 projection left
        assert sum(isinstance(m, Int4Linear) for m in modules) == 7 * len(blocks.range)
        assert all(weights is not None for weights in blocks.kernels._fused)  # every layer runs fused
        # the forms calibrated for these weights, whichever range they are in
        assert type(blocks.kernels) is type(joined.kernels) and blocks.kernels.forms == joined.kernels.forms
        assert [blocks.kernels.form(rows) for rows in ROWS] == [joined.kernels.form(rows) for rows in ROWS]
        assert blocks.weight_bytes == per_layer * len(blocks.range)
    assert moved.layers[1] is held.layers[0] and moved.layers[2] is held.layers[1]  # shared, not loaded again
    # held as 4-bit: nibbles and a float32 scale and minimum per 32 weights, plus the norms
    assert per_layer < spec.layer_bytes("float32") * 5 // 16
    hidden = torch.randn(8, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = _decode(joined, hidden)
    for blocks in (moved, budgeted):
        assert all(torch.equal(a, b) for a, b in zip(expected, _decode(blocks, hidden), strict=True))


def test_memory_counts_the_weights_as_held(four_bit_source: ModelSource) -> None:
    """A budget holds as many layers as their held weights and caches take, and spares what they leave."""
    spec, per_layer = four_bit_source.spec, four_bit_source.held_layer_bytes()
    cache = 100 * spec.kv_bytes_per_token("float32")
    budget = 3 * (per_layer + cache)
    assert max_layers_within(spec, "float32", budget, 100, per_layer) == 3
    assert max_layers_within(spec, "float32", budget - 1, 100, per_layer) == 2
    assert max_layers_within(spec, "float32", budget, 100) < 3  # counted as float32, fewer fit
    assert packing_bytes(spec, "float32", budget, 100, 2, per_layer) == per_layer + cache
