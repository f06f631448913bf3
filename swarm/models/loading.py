"""Finding a model and loading the parts a peer or client needs, reading only those tensors.

    source = resolve_model("default")        # or "tiny", "tiny:7", or a local HF checkpoint dir
    blocks = source.load_blocks(10, 20)      # reads model.layers.10 .. model.layers.19 only
    head = source.load_head()                # reads embed_tokens, norm, lm_head only

Checkpoints are safetensors dirs; tensors are read by name with safe_open, so a peer holding 10 of 80 layers
never touches the other 70 (the OS page cache only maps what we read).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from swarm import config as swarm_config
from swarm.models import checkpoints, hub
from swarm.models.backends import for_device
from swarm.models.blocks import BlockRange, family_classes
from swarm.models.device import parse_device
from swarm.models.head import ClientHead
from swarm.models.spec import ModelSpec, dtype_name, torch_dtype
from swarm.types import LayerRange

logger = logging.getLogger(__name__)

DEFAULT_CACHE_TOKENS = 16384  # KV cache budget of a BlockRange unless the caller sets one
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def resolve_model(model: str) -> ModelSource:
    """ "default" (packaged SmolLM2-135M GGUF), "tiny" / "tiny:SEED" (random tiny Llama), an HF dir path, or a
    hub id ORG/NAME (downloaded once into the model cache: swarm/models/hub.py)."""
    _set_torch_threads()
    if model == "default":
        return ModelSource(checkpoints.ensure_default_checkpoint())
    if model == "tiny" or model.startswith("tiny:"):
        seed_text = model.partition(":")[2] or "0"
        if not seed_text.isdigit():
            raise ValueError(f"bad tiny model {model!r}: expected tiny or tiny:SEED with an integer SEED")
        return ModelSource(checkpoints.ensure_tiny_checkpoint(int(seed_text)))
    if hub.is_hub_id(model):  # ORG/NAME, and no such local path
        return ModelSource(hub.fetch(model))
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither 'default', 'tiny[:SEED]', a checkpoint dir with a config.json "
            "nor a hub id ORG/NAME"
        )
    return ModelSource(path)


def _set_torch_threads() -> None:
    threads = swarm_config.torch_threads()
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class ModelSource:
    """A safetensors checkpoint dir of one of spec.FAMILIES: its spec, config and tensors, loadable piece by
    piece."""

    def __init__(self, path: Path) -> None:
        checkpoints.offline_hub()
        from transformers import AutoConfig

        self.path = path
        self._prefix = "model."  # checkpoints of every family we run name decoder tensors model.layers.N.*
        self.config: Any = AutoConfig.from_pretrained(path, local_files_only=True)
        self._files = self._tensor_files()  # tensor name -> file holding it
        meta = checkpoints.read_metadata(path)
        name = meta["name"] if meta else path.name
        digest = meta["weights_hash"] if meta else checkpoints.weights_hash(path)
        self.spec = ModelSpec.from_config(
            self.config, name=name, dtype=self._stored_dtype(), weights_hash=digest
        )
        self._prefix = "model."
        # by (device, dtype, quant): held_layer_bytes
        self._held_layer_bytes: dict[tuple[str, str, str], int] = {}

    def __repr__(self) -> str:
        return f"ModelSource({self.spec.name!r}, {self.path})"

    def _tensor_files(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.path / file for name, file in weight_map.items()}
        files: dict[str, Path] = {}
        for file in checkpoints.weight_files(self.path):
            with safe_open(str(file), framework="pt") as f:  # reads the header only
                files.update(dict.fromkeys(f.keys(), file))
        return files

    def _stored_dtype(self) -> str:
        if not self._files:
            raise ValueError(f"checkpoint {self.path} holds no tensors")
        name = next((n for n in self._files if n.endswith("norm.weight")), next(iter(self._files)))
        with safe_open(str(self._files[name]), framework="pt") as f:
            stored = f.get_slice(name).get_dtype()  # from the header, no data read
        return _SAFETENSORS_DTYPES.get(stored, "float32")

    def read_tensors(
        self, names: Iterable[str], device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Read exactly these tensors, opening each file once."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            if name not in self._files:
                raise ValueError(f"checkpoint {self.path} has no tensor {name!r}")
            by_file[self._files[name]].append(name)
        out = {}
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        return out

    def tokenizer(self) -> Any:
        """The checkpoint's AutoTokenizer, or None when it has none (the tiny model)."""
        if not any(
            (self.path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        ):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)

    def load_blocks(
        self,
        start: int,
        end: int,
        device: str = "cpu",
        dtype: str = "float32",
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
        pack_bytes: int = 0,
        quant: str = "none",
    ) -> BlockRange:
        """Layers [start, end), reading only their tensors (``pack_bytes``, ``quant``: see BlockRange)."""
        layers = LayerRange(start, end)
        layers.check_within(self.spec.num_layers)
        torch_device, torch_type = parse_device(device), torch_dtype(dtype)
        _set_torch_threads()
        began = time.perf_counter()
        backend = for_device(torch_device, torch_type, quant, self.spec.model_type)
        # each layer held in the backend's form as it is read, so a float32 copy of one layer at most is alive
        modules = [backend.hold(self._layer(layer, torch_device, torch_type)) for layer in range(start, end)]
        logger.info(
            "loaded layers %s of %s on %s (%s%s) in %.2f s",
            layers,
            self.spec.name,
            device,
            dtype,
            "" if quant == "none" else f", {quant}",
            time.perf_counter() - began,
        )
        return BlockRange(
            self.spec, self.config, modules, layers, cache_tokens, torch_device, torch_type, pack_bytes, quant
        )

    def _layer(self, layer: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """Decoder layer ``layer`` as its transformers module, reading only its tensors."""
        layer_class, _, _ = family_classes(self.spec.model_type)
        prefix = f"{self._prefix}layers.{layer}."
        names = [n for n in self._files if n.startswith(prefix)]
        tensors = self.read_tensors(names, device, dtype)
        with torch.device("meta"):
            module = layer_class(self.config, layer_idx=layer)
        state = {n[len(prefix) :]: t for n, t in tensors.items()}
        if self.spec.num_experts:
            state = _fused_experts(state, self.spec.num_experts)
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval()

    def held_layer_bytes(self, device: str = "cpu", dtype: str = "float32", quant: str = "none") -> int:
        """Bytes one decoder layer's weights take as ``device``'s backend holds them (the first layer, loaded
        and held once): what a memory budget counts per layer (3/16 of float32 for a CPU's 4-bit weights;
        nf4: ~4.13 bits a projection weight, its block scales included)."""
        key = (device, dtype, quant)
        if key not in self._held_layer_bytes:
            torch_device, torch_type = parse_device(device), torch_dtype(dtype)
            _set_torch_threads()
            backend = for_device(torch_device, torch_type, quant, self.spec.model_type)
            layer = backend.hold(self._layer(0, torch_device, torch_type))
            self._held_layer_bytes[key] = backend.held_bytes([layer])
        return self._held_layer_bytes[key]

    def load_head(self, device: str = "cpu", dtype: str = "float32") -> ClientHead:
        """Embeddings, final norm and LM head (tied to the embeddings when the config says so)."""
        torch_device, torch_type = parse_device(device), torch_dtype(dtype)
        _set_torch_threads()
        embed_name, norm_name = f"{self._prefix}embed_tokens.weight", f"{self._prefix}norm.weight"
        tied = bool(getattr(self.config, "tie_word_embeddings", False)) or "lm_head.weight" not in self._files
        names = [embed_name, norm_name] + ([] if tied else ["lm_head.weight"])
        tensors = self.read_tensors(names, torch_device, torch_type)
        _, _, norm_class = family_classes(self.spec.model_type)
        norm: Any = norm_class(self.spec.hidden_size, eps=self.config.rms_norm_eps).to(
            torch_device, torch_type
        )
        norm.weight.data.copy_(tensors[norm_name])
        lm_head = tensors[embed_name] if tied else tensors["lm_head.weight"]
        # Gemma scales its embeddings by sqrt(hidden size); Gemma 2 soft-caps its logits
        scaled = self.spec.family in ("gemma2", "gemma3")
        embed_scale = float(self.spec.hidden_size**0.5) if scaled else None
        softcap = getattr(self.config, "final_logit_softcapping", None)
        return ClientHead(self.spec, tensors[embed_name], norm.eval(), lm_head, embed_scale, softcap)

    def load_reference_model(self, device: str = "cpu", dtype: str = "float32") -> Any:
        """The whole model as a plain transformers *ForCausalLM (tests and benchmarks compare against it)."""
        from transformers import AutoModelForCausalLM

        _set_torch_threads()
        model: Any = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch_dtype(dtype), local_files_only=True
        )
        return model.to(parse_device(device)).eval()


def _fused_experts(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """A Mixtral layer's tensors as its module takes them: checkpoints keep each expert's w1 (gate), w3 (up)
    and w2 (down) under block_sparse_moe; the module holds them fused, gate_up_proj [E, 2I, H] and down_proj
    [E, H, I], and the router under mlp.gate. A layer already in the module's form is left as it is."""
    old = "block_sparse_moe."
    if not any(name.startswith(old) for name in state):
        return state
    out = {name: t for name, t in state.items() if not name.startswith(old)}
    experts = [f"{old}experts.{e}." for e in range(num_experts)]
    try:
        out["mlp.gate.weight"] = state[f"{old}gate.weight"]
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{e}w1.weight"], state[f"{e}w3.weight"]]) for e in experts]
        )
        out["mlp.experts.down_proj"] = torch.stack([state[f"{e}w2.weight"] for e in experts])
    except KeyError as e:
        raise ValueError(
            f"a Mixtral layer lacks tensor {e}: not a checkpoint of {num_experts} experts"
        ) from None
    known = {f"{old}gate.weight"} | {f"{e}{w}.weight" for e in experts for w in ("w1", "w2", "w3")}
    unknown = sorted(name for name in state if name.startswith(old) and name not in known)
    if unknown:
        raise ValueError(f"unexpected Mixtral tensors {unknown[:3]}")
    return out


__all__ = ["ModelSource", "resolve_model", "parse_device", "dtype_name", "DEFAULT_CACHE_TOKENS"]
