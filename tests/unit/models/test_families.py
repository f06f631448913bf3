"""Qwen3, Mixtral, Gemma 2 and Gemma 3: tiny random checkpoints written by transformers run through our ranges and head
with the logits of transformers, stateless and with sessions, split over ranges, past Gemma's window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.models import ModelSpec, Step, resolve_model
from swarm.models.backends import TorchBackend
from swarm.models.backends.families import Gemma2Range, Gemma3Range, MixtralRange, Qwen3Range
from swarm.models.loading import ModelSource
from swarm.models.spec import FAMILIES
from swarm.testing.families import FAMILY_CONFIGS, GEMMA2_WINDOW, tiny_family_model, write_tiny_family

pytestmark = pytest.mark.timeout(120)

MODEL_TYPES = sorted(FAMILY_CONFIGS)
RANGES = {"qwen3": Qwen3Range, "mixtral": MixtralRange, "gemma2": Gemma2Range, "gemma3_text": Gemma3Range}
IDS = torch.tensor([5, 17, 42, 99, 7, 3, 250, 11, 1, 2, 3, 4, 5, 6, 300, 12, 77, 8])  # 18 > Gemma's window
SPLIT = [(0, 2), (2, 5), (5, 6)]
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelSource, Any]:
    model_type = request.param
    path = write_tiny_family(tmp_path_factory.mktemp(model_type) / model_type, model_type)
    source = resolve_model(str(path))
    return source, source.load_reference_model()


def _reference_logits(reference: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids[None]).logits[0]  # [T, V]


def test_the_spec_knows_the_family(family: tuple[ModelSource, Any]) -> None:
    source, reference = family
    spec = source.spec
    assert spec.model_type == reference.config.model_type and spec.family == FAMILIES[spec.model_type]
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.head_dim == source.load_blocks(0, 1).head_dim
    layer = reference.model.layers[0]
    params = sum(p.numel() for p in layer.parameters())
    # layer_params counts attention, MLP (every expert) and two norms: the rest is q/k norms or Gemma's two more
    assert 0 <= params - spec.layer_params() <= 2 * spec.hidden_size + 2 * spec.head_dim


def test_a_family_runs_its_own_layer_in_plain_torch(family: tuple[ModelSource, Any]) -> None:
    source, _ = family
    for dtype in ("float32", "bfloat16"):
        blocks = source.load_blocks(0, 2, dtype=dtype)
        assert type(blocks.kernels) is RANGES[source.spec.model_type]
        assert type(blocks.backend) is TorchBackend  # not the CPU backend, whose forms are the Llama block


def test_split_stateless_steps_equal_transformers(family: tuple[ModelSource, Any]) -> None:
    source, reference = family
    head = source.load_head()
    hidden = head.embed(IDS)
    for start, end in SPLIT:
        hidden = source.load_blocks(start, end).forward([Step(None, hidden, start, end, 0)])[0]
    expected = _reference_logits(reference, IDS)
    assert (head.logits(hidden) - expected).abs().max().item() <= TOLERANCE


def test_split_sessions_prefill_then_decode_equal_transformers(family: tuple[ModelSource, Any]) -> None:
    """A prompt of 5 tokens, then one token a step, each through three ranges with their caches."""
    source, reference = family
    head = source.load_head()
    ranges = [source.load_blocks(start, end) for start, end in SPLIT]
    for blocks in ranges:
        blocks.open_session("s", len(IDS))
    pieces = [(0, 5)] + [(i, i + 1) for i in range(5, len(IDS))]
    outputs = []
    for first, last in pieces:
        hidden = head.embed(IDS[first:last])
        for blocks, (start, end) in zip(ranges, SPLIT, strict=True):
            hidden = blocks.forward([Step("s", hidden, start, end, first)])[0]
        outputs.append(hidden)
    got = head.logits(torch.cat(outputs))
    assert (got - _reference_logits(reference, IDS)).abs().max().item() <= TOLERANCE
    greedy = head.logits(torch.cat(outputs), argmax_only=True).argmax(-1)
    assert torch.equal(greedy, _reference_logits(reference, IDS).argmax(-1))


def test_mixtral_routes_each_token_of_a_batch_on_its_own(tmp_path: Path) -> None:
    """Decode steps of three sessions in one call ([1, 3, H] through the experts) give what each gives alone,
    and the tokens of that call do not all choose the same experts."""
    source = resolve_model(str(write_tiny_family(tmp_path / "mixtral", "mixtral")))
    head = source.load_head()
    prompts = [IDS[:6], IDS[6:12], IDS[12:18]]
    together, alone = source.load_blocks(0, 6), source.load_blocks(0, 6)
    for blocks in (together, alone):
        for i, prompt in enumerate(prompts):
            blocks.open_session(f"s{i}", 16)
            blocks.forward([Step(f"s{i}", head.embed(prompt), 0, 6, 0)])
    inputs: list[torch.Tensor] = []  # what each layer's experts were given in the batched call
    experts = together.kernels.mlp

    def recording(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        inputs.append(x.reshape(-1, x.shape[-1]))
        return experts(mlp, x)  # type: ignore[attr-defined]

    together.kernels.mlp = recording  # type: ignore[attr-defined]
    nexts = [head.embed(torch.tensor([t])) for t in (9, 99, 199)]
    batched = together.forward([Step(f"s{i}", h, 0, 6, 6) for i, h in enumerate(nexts)])
    for i, h in enumerate(nexts):
        (one,) = alone.forward([Step(f"s{i}", h, 0, 6, 6)])
        assert (batched[i] - one).abs().max().item() <= 1e-5
    assert len(inputs) == 6 and inputs[0].shape[0] == 3  # one call of three rows a layer
    for layer, x in zip(together.layers, inputs, strict=True):
        router: Any = layer.mlp.gate  # type: ignore[union-attr]
        chosen = torch.topk(x @ router.weight.T, 2, dim=-1).indices.sort(-1).values  # [3, 2]
        assert len({tuple(row.tolist()) for row in chosen}) > 1, "the three rows chose different experts"


def test_mixtral_checkpoints_missing_an_expert_fail_at_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = write_tiny_family(tmp_path / "mixtral", "mixtral")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(path / "model.safetensors"), {"format": "pt"})
    source = resolve_model(str(path))
    source.load_blocks(0, 1)
    with pytest.raises(ValueError, match="lacks tensor"):
        source.load_blocks(1, 2)


def test_gemma2_attends_inside_its_window_without_refusing_longer_sessions(tmp_path: Path) -> None:
    """Sessions longer than the window are served (the window is applied, not refused), and the test sequence
    is long enough for the window to matter: transformers' logits without it differ."""
    source = resolve_model(str(write_tiny_family(tmp_path / "gemma2", "gemma2")))
    blocks = source.load_blocks(0, 2)
    assert blocks.max_context_tokens is None
    blocks.open_session("long", 4 * GEMMA2_WINDOW)
    assert [w for w in blocks.kernels.windows] == [GEMMA2_WINDOW, None]  # type: ignore[attr-defined]
    windowed = _reference_logits(tiny_family_model("gemma2"), IDS)
    unwindowed_model = tiny_family_model("gemma2")
    for layer in unwindowed_model.model.layers:
        layer.self_attn.sliding_window = None
    unwindowed_model.config.layer_types = ["full_attention"] * len(unwindowed_model.model.layers)
    unwindowed = _reference_logits(unwindowed_model, IDS)
    assert torch.equal(windowed[:GEMMA2_WINDOW], unwindowed[:GEMMA2_WINDOW])
    assert (windowed[GEMMA2_WINDOW:] - unwindowed[GEMMA2_WINDOW:]).abs().max().item() > 1e-2


def test_gemma2_head_scales_embeddings_and_caps_logits(tmp_path: Path) -> None:
    source = resolve_model(str(write_tiny_family(tmp_path / "gemma2", "gemma2")))
    head = source.load_head()
    reference = source.load_reference_model()
    ids = IDS[:4]
    assert torch.equal(head.embed(ids), reference.model.embed_tokens(ids))
    cap = FAMILY_CONFIGS["gemma2"]["final_logit_softcapping"]
    logits = head.logits(torch.randn(3, source.spec.hidden_size) * 10)
    assert logits.abs().max().item() <= cap and (logits.abs() > cap / 2).any()


def test_gemma3_sliding_layers_turn_at_their_own_rope_base(tmp_path: Path) -> None:
    """The tiny Gemma 3's two RoPE bases differ (so the exactness tests above would catch local angles taken for
    global ones), and a range's sliding layers get the local angles."""
    source = resolve_model(str(write_tiny_family(tmp_path / "gemma3", "gemma3_text")))
    bases = {kind: p["rope_theta"] for kind, p in source.config.rope_parameters.items()}
    assert bases["sliding_attention"] != bases["full_attention"]
    blocks = source.load_blocks(0, 2)
    assert blocks.kernels.sliding == [True, False]  # type: ignore[attr-defined]
    assert blocks.max_context_tokens is None


def test_bfloat16_ranges_run_close_to_float32(family: tuple[ModelSource, Any]) -> None:
    """Head and ranges in bfloat16 (the dtype a GPU peer runs) stay within bfloat16's rounding of transformers'
    float32 logits: every op of the family's layer takes 16-bit inputs."""
    source, reference = family
    head = source.load_head(dtype="bfloat16")
    hidden = head.embed(IDS)
    for start, end in SPLIT:
        hidden = source.load_blocks(start, end, dtype="bfloat16").forward(
            [Step(None, hidden, start, end, 0)]
        )[0]
    assert hidden.dtype == torch.bfloat16
    expected = _reference_logits(reference, IDS)
    assert (head.logits(hidden) - expected).abs().max().item() <= 0.1 * expected.abs().max().item()


def test_a_bidirectional_gemma_fails_at_load(tmp_path: Path) -> None:
    """Attention we would compute causally where the checkpoint's is not: refused when the layers load."""
    import json

    path = write_tiny_family(tmp_path / "gemma2", "gemma2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="bidirectional"):
        resolve_model(str(path)).load_blocks(0, 2)


def test_a_gemma3_decode_call_between_a_prefills_layers_leaves_both_exact(tmp_path: Path) -> None:
    """The executor runs a decode call between the layers of a prefill chunk on the same range: each call keeps
    its own sliding layers' angles."""
    source = resolve_model(str(write_tiny_family(tmp_path / "gemma3", "gemma3_text")))
    head, blocks = source.load_head(), source.load_blocks(0, 6)
    ids = torch.tensor([5, 17, 42, 99, 7, 3, 250, 11, 1, 2, 3, 4])
    for session in ("p", "d", "alone", "d-alone"):
        blocks.open_session(session, 64)
    for session in ("d", "d-alone"):
        blocks.forward([Step(session, head.embed(ids[:5]), 0, 6, 0)])
    prefill_alone = blocks.forward([Step("alone", head.embed(ids), 0, 6, 0)])[0]
    decode_alone = blocks.forward([Step("d-alone", head.embed(ids[5:6]), 0, 6, 5)])[0]
    decoded: list[torch.Tensor] = []

    def decode_between() -> None:
        if not decoded:
            decoded.append(blocks.forward([Step("d", head.embed(ids[5:6]), 0, 6, 5)])[0])

    prefill = blocks.forward([Step("p", head.embed(ids), 0, 6, 0)], decode_between)[0]
    assert torch.allclose(prefill, prefill_alone, atol=1e-5)
    assert torch.allclose(decoded[0], decode_alone, atol=1e-5)
