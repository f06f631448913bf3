"""Loading checkpoints: only the requested tensors are read, hashes are stable and cached, dirs are atomic."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from swarm.errors import ProtocolError
from swarm.models import ModelSpec, Step, checkpoints, loading, resolve_model

pytestmark = pytest.mark.timeout(60)


class RecordingSafeOpen:
    """Wraps safetensors.safe_open and records the name of every tensor read from it."""

    def __init__(self, real, read: list[str]) -> None:  # type: ignore[no-untyped-def]
        self.real, self.read = real, read

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        handle, read = self.real(*args, **kwargs), self.read

        class Handle:
            def __enter__(self):  # type: ignore[no-untyped-def]
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc):  # type: ignore[no-untyped-def]
                return handle.__exit__(*exc)

            def keys(self):  # type: ignore[no-untyped-def]
                return self.inner.keys()

            def get_slice(self, name):  # type: ignore[no-untyped-def]
                return self.inner.get_slice(name)  # header only: dtype and shape

            def get_tensor(self, name):  # type: ignore[no-untyped-def]
                read.append(name)
                return self.inner.get_tensor(name)

        return Handle()


@pytest.fixture()
def sharded_dir(tmp_path: Path) -> Path:
    """A 24-layer tiny Llama written as a sharded HF dir (about a dozen 64 KiB shards)."""
    checkpoints.write_tiny_checkpoint(tmp_path / "tiny24", seed=1, num_layers=24, max_shard_bytes=64 << 10)
    return tmp_path / "tiny24"


def test_load_blocks_reads_only_its_layers(sharded_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (sharded_dir / "model.safetensors.index.json").exists()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 3
    read: list[str] = []
    monkeypatch.setattr(loading, "safe_open", RecordingSafeOpen(loading.safe_open, read))
    source = resolve_model(str(sharded_dir))
    assert read == []  # building the spec reads headers only

    blocks = source.load_blocks(10, 20)
    layers = {int(name.split(".")[2]) for name in read}
    assert layers == set(range(10, 20)) and all(name.startswith("model.layers.") for name in read)
    assert len(read) == 10 * 9  # 7 projections + 2 norms per layer

    read.clear()
    head = source.load_head()
    assert sorted(read) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]

    # and the partial load computes what the full transformers model computes
    reference = source.load_reference_model()
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        expected = reference(ids[None], output_hidden_states=True).hidden_states
    got = blocks.forward([Step(None, expected[10][0], 10, 20, 0)])[0]
    assert (got - expected[20][0]).abs().max().item() <= 1e-5
    assert torch.equal(head.embed(ids), expected[0][0])


def test_tiny_weights_are_deterministic(tmp_path: Path) -> None:
    checkpoints.write_tiny_checkpoint(tmp_path / "again", seed=0)
    assert checkpoints.weights_hash_uncached(tmp_path / "again") == resolve_model("tiny:0").spec.weights_hash
    assert resolve_model("tiny:1").spec.weights_hash != resolve_model("tiny:0").spec.weights_hash
    assert resolve_model("tiny").spec == resolve_model("tiny:0").spec


def test_weights_hash_is_cached_by_size_and_mtime(
    sharded_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWSWARM_CACHE", str(tmp_path / "cache"))
    hashed: list[Path] = []
    real = checkpoints._file_sha256
    monkeypatch.setattr(checkpoints, "_file_sha256", lambda p: hashed.append(p) or real(p))
    first = checkpoints.weights_hash(sharded_dir)
    count = len(hashed)
    assert count == len(list(sharded_dir.glob("*.safetensors")))
    assert checkpoints.weights_hash(sharded_dir) == first and len(hashed) == count  # warm: no rehash
    assert first == checkpoints.weights_hash_uncached(sharded_dir)


def test_concurrent_creation_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWSWARM_CACHE", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            results.append(checkpoints.ensure_tiny_checkpoint(7))
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-7"]  # no temp dirs left
    assert resolve_model("tiny:7").spec.num_layers == 6


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_llama_family_variants_match_transformers(model_type: str, tmp_path: Path) -> None:
    """Mistral and Qwen2 (q/k/v biases) HF dirs run through our block and match transformers."""
    import transformers

    prefix = {"mistral": "Mistral", "qwen2": "Qwen2"}[model_type]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    if model_type == "qwen2":  # non-zero biases so a dropped bias would show
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
    model.save_pretrained(tmp_path / model_type)

    source = resolve_model(str(tmp_path / model_type))
    assert source.spec.model_type == model_type and source.spec.family == "llama"
    head, blocks = source.load_head(), source.load_blocks(1, 4)
    ids = torch.tensor([1, 2, 3, 50, 60, 70])
    with torch.no_grad():
        expected = model(ids[None], output_hidden_states=True)
    hidden = blocks.forward([Step(None, expected.hidden_states[1][0], 1, 4, 0)])[0]
    assert (head.logits(hidden) - expected.logits[0]).abs().max().item() <= 1e-4
    if model_type == "mistral":  # full attention is only exact inside the sliding window: longer is refused
        with pytest.raises(ProtocolError, match="sliding window"):
            blocks.open_session("long", config.sliding_window + 1)


def test_bad_model_names() -> None:
    with pytest.raises(ValueError, match="tiny:SEED"):
        resolve_model("tiny:x")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model("/no/such/dir")


def test_spec_round_trip_and_sizes() -> None:
    spec = resolve_model("tiny:0").spec
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.activation_bytes_per_token == 64 * 4
    assert spec.kv_bytes_per_token("bfloat16") == 2 * 2 * 16 * 2
    with pytest.raises(ValueError, match="bad model spec"):
        ModelSpec.from_dict({"name": "x"})
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelSpec.from_dict({**spec.to_dict(), "dtype": "int4"})
