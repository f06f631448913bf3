"""--quant: a peer's layers held through bitsandbytes (int8, nf4) give the greedy tokens of transformers loading
the same checkpoint with the same BitsAndBytesConfig, count their quantized bytes in the memory estimate, and
never run the CPU's own kernels; without bitsandbytes, asking for them fails at once, in one line."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import pytest
import torch

from client.config import ClientConfig
from client.local import in_process_client
from swarm.models.backends import for_device
from swarm.models.head import SamplingParams
from swarm.models.loading import ModelSource
from swarm.models.quant import bitsandbytes, check_runs, reference_config
from swarm.peer.measure import max_layers_within
from swarm.testing.reference import greedy_tokens
from swarm.types import LayerRange, NodeID

pytestmark = pytest.mark.timeout(300)

try:
    import bitsandbytes as bnb
except Exception as e:  # not installed, or its native library does not load here
    bnb, MISSING = None, f"bitsandbytes cannot be imported here: {e!r}"
else:
    MISSING = ""
needs_bnb = pytest.mark.skipif(bnb is None, reason=MISSING or "bitsandbytes present")

SPLIT = {"a": (0, 2), "b": (2, 4), "c": (4, 6)}
PROMPT_IDS = [5, 17, 42, 99, 7, 3, 250, 11]
NEW_TOKENS = 12
PROJECTIONS = 7  # q, k, v, o, gate, up, down


@pytest.fixture(autouse=True)
def _quiet_int8() -> None:
    # bitsandbytes warns on every int8 call that float32 inputs are cast to float16 (they are, on both sides)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def _split_greedy(source: ModelSource, quant: str, dtype: str, device: str = "cpu") -> list[int]:
    blocks = {
        name: source.load_blocks(a, b, device, dtype, cache_tokens=1024, quant=quant)
        for name, (a, b) in SPLIT.items()
    }
    config = ClientConfig(
        retry_delay_s=0.0, spot_check_rate=0.0, speculate="off", device=device, dtype=dtype, quant=quant
    )
    client = in_process_client(source.load_head(device, dtype), blocks, None, config)
    return asyncio.run(client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()))


def _reference(source: ModelSource, quant: str, dtype: str, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    torch_type = getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(
        source.path,
        quantization_config=reference_config(quant, torch_type),
        dtype=torch_type,
        device_map=device,
        local_files_only=True,
    ).eval()


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@needs_bnb
@pytest.mark.parametrize(
    ("quant", "dtype", "device"),
    [
        ("nf4", "float32", "cpu"),
        ("nf4", "bfloat16", "cpu"),
        ("int8", "float32", "cpu"),
        pytest.param("nf4", "float16", "cuda", marks=ON_GPU),
        pytest.param("nf4", "bfloat16", "cuda", marks=ON_GPU),
        pytest.param("int8", "float16", "cuda", marks=ON_GPU),
    ],
)
def test_split_ranges_give_the_tokens_of_transformers_with_the_same_config(
    tiny_source: ModelSource, quant: str, dtype: str, device: str
) -> None:
    reference = _reference(tiny_source, quant, dtype, device)
    assert isinstance(reference.model.layers[0].mlp.down_proj, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    want = greedy_tokens(reference, PROMPT_IDS, NEW_TOKENS)
    assert _split_greedy(tiny_source, quant, dtype, device) == want


@needs_bnb
def test_nf4_changes_the_answer_of_this_model(tiny_source: ModelSource) -> None:
    """The tokens compared above are those of quantized weights: unquantized ones answer otherwise here."""
    plain = greedy_tokens(tiny_source.load_reference_model(), PROMPT_IDS, NEW_TOKENS)
    assert _split_greedy(tiny_source, "nf4", "float32") != plain


@needs_bnb
@pytest.mark.parametrize(
    ("quant", "module", "stored"), [("nf4", "Linear4bit", torch.uint8), ("int8", "Linear8bitLt", torch.int8)]
)
def test_every_projection_is_held_quantized(
    tiny_source: ModelSource, quant: str, module: str, stored: torch.dtype
) -> None:
    blocks = tiny_source.load_blocks(0, 2, quant=quant)
    assert blocks.quant == quant and blocks.backend.name == f"bitsandbytes-{quant}"
    held = [m for layer in blocks.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(held) == 2 * PROJECTIONS
    assert all(type(m).__name__ == module and m.weight.dtype == stored for m in held)


@needs_bnb
def test_quantized_ranges_never_take_the_cpus_own_kernels() -> None:
    cpu = torch.device("cpu")
    assert for_device(cpu, torch.float32).name == "cpu"  # what an unquantized float32 CPU range runs
    assert for_device(cpu, torch.float32, "nf4").name == "bitsandbytes-nf4"
    assert for_device(cpu, torch.float32, "int8").name == "bitsandbytes-int8"
    with pytest.raises(ValueError, match="Llama-family layers only"):  # a family with a layer of its own
        for_device(cpu, torch.float32, "nf4", "qwen3")


@needs_bnb
def test_the_memory_estimate_counts_quantized_bytes(tiny_source: ModelSource) -> None:
    spec = tiny_source.spec
    projection_weights = spec.hidden_size * (
        2 * spec.hidden_size  # q, o
        + 2 * spec.num_kv_heads * (spec.hidden_size // spec.num_heads)  # k, v
        + 3 * spec.intermediate_size  # gate, up, down
    )
    other = 2 * spec.hidden_size * 2  # the two norms' bfloat16 weights
    full = tiny_source.held_layer_bytes("cpu", "bfloat16")
    assert full == 2 * projection_weights + other
    nf4 = tiny_source.held_layer_bytes("cpu", "bfloat16", "nf4")
    int8 = tiny_source.held_layer_bytes("cpu", "bfloat16", "int8")
    # nf4: half a byte a weight, one byte per 64 (block scales), and per projection the scales' own scales
    # and the two lookup tables (a fixed cost that is large only in a model this small)
    tables = PROJECTIONS * (16 * 4 + 256 * 4 + 64)
    assert (
        projection_weights // 2 + projection_weights // 64 + other
        <= nf4
        <= (projection_weights * 4.25 / 8 + other + tables)
    )
    # int8: a byte a weight and a float32 scale per output row
    assert (
        projection_weights + other
        <= int8
        <= projection_weights + other + 4 * projection_weights // spec.hidden_size
    )
    assert nf4 < int8 < full
    blocks = tiny_source.load_blocks(0, 3, dtype="bfloat16", quant="nf4")
    assert blocks.weight_bytes == 3 * nf4
    # --layers auto: a budget of three bfloat16 layers (no cache) holds every layer in nf4
    assert max_layers_within(spec, "bfloat16", 3 * full, 0, full) == 3
    assert max_layers_within(spec, "bfloat16", 3 * full, 0, nf4) == spec.num_layers


@needs_bnb
def test_spot_checks_pass_between_peers_holding_their_weights_alike(tiny_source: ModelSource) -> None:
    """b (nf4) and bf (unquantized) both hold layers 2:4 and answer differently, both honestly: an nf4 client
    routes and checks among nf4 peers only (b, b2), and nobody is excluded."""
    kinds = {"a": "nf4", "b": "nf4", "b2": "nf4", "bf": "none", "c": "nf4"}
    spans = {"a": (0, 2), "b": (2, 4), "b2": (2, 4), "bf": (2, 4), "c": (4, 6)}
    blocks = {
        name: tiny_source.load_blocks(*spans[name], cache_tokens=1024, quant=kind)
        for name, kind in kinds.items()
    }
    config = ClientConfig(
        retry_delay_s=0.0, spot_check_rate=1.0, spot_check_blocking=True, speculate="off", quant="nf4"
    )
    client = in_process_client(tiny_source.load_head(), blocks, None, config)
    layers = LayerRange(2, 4)
    assert sorted(asyncio.run(client.routes.holders(layers))) == ["b", "b2"]  # an nf4 client's: not bf
    assert sorted(asyncio.run(client.routes.holders(layers, like=NodeID("b")))) == ["b", "b2"]
    asyncio.run(client.generate_ids(PROMPT_IDS, NEW_TOKENS, SamplingParams()))
    assert client.checker.checks_run > 0 and not client.checker.excluded


@needs_bnb
def test_a_bitsandbytes_that_cannot_quantize_here_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    check_runs("nf4", cpu, torch.float32)  # it can, here
    check_runs("int8", cpu, torch.bfloat16)

    def no_kernel(*args: object, **kwargs: object) -> None:  # as a build without this device's kernels
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", no_kernel)
    with pytest.raises(
        ValueError, match="--quant nf4 cannot run on cpu .* RuntimeError: no kernel for this device;"
    ):
        check_runs("nf4", cpu, torch.float32)


def test_without_bitsandbytes_quant_fails_at_once(
    tiny_source: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    for quant in ("nf4", "int8"):
        with pytest.raises(ValueError, match=f"--quant {quant} needs bitsandbytes.*pip install bitsandbytes"):
            bitsandbytes(quant)
        with pytest.raises(ValueError, match="needs bitsandbytes"):
            tiny_source.load_blocks(0, 1, quant=quant)
    with pytest.raises(ValueError, match="unknown quant"):
        bitsandbytes("fp3")
