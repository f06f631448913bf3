"""ModelSpec: the few numbers about a model that peers, the planner and clients must agree on.

It travels in DHT records and handshakes, so it is plain data with an explicit dict form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from swarm.wire import WIRE_DTYPES as DTYPES

# transformers model_type -> family. The "llama" family's decoder layer is the Llama block (RMSNorm, RoPE, GQA
# attention, SwiGLU MLP): Mistral and Qwen2 differ only in config details (sliding window, q/k/v biases) handled by
# their modules. The others have a layer of their own (swarm.models.backends.families): Qwen3 norms q and k per
# head, Mixtral's MLP is a mixture of experts, Gemma 2 has more norms, soft-capping and sliding-window layers,
# Gemma 3 (its text-only checkpoints) norms q and k and turns the sliding layers' RoPE at a base of its own.
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


def torch_dtype(name: str) -> torch.dtype:
    """ "float16" -> torch.float16, with a clear error for anything we do not run."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}: choose one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class ModelSpec:
    """What a model is, independent of where its weights live."""

    name: str  # human name, e.g. "SmolLM2-135M-Instruct" or "tiny-0"
    family: str  # "llama" (also Mistral and Qwen2 checkpoints), "qwen3", "mixtral", "gemma2" or "gemma3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    dtype: str  # dtype of the checkpoint's weights as stored ("float32", "bfloat16", "float16")
    weights_hash: str  # hex sha256 over the weight files: equal hashes mean the same weights
    intermediate_size: int = 0  # MLP width; 0 when unknown (older records)
    model_type: str = "llama"  # transformers model_type: a key of FAMILIES
    head_size: int = 0  # width of one attention head; 0 when it is hidden_size // num_heads
    num_experts: int = 0  # experts of a mixture-of-experts MLP, each intermediate_size wide; 0: one dense MLP

    def __post_init__(self) -> None:
        if self.family not in set(FAMILIES.values()):
            raise ValueError(f"unknown model family {self.family!r}")
        if min(self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.vocab_size) <= 0:
            raise ValueError(f"model spec {self.name!r} has a non-positive size: {self}")
        if (self.head_size <= 0 and self.hidden_size % self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model spec {self.name!r}: heads do not divide hidden size / kv heads")
        if self.head_size < 0 or self.num_experts < 0:
            raise ValueError(f"model spec {self.name!r} has a negative head size or expert count: {self}")
        torch_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def activation_bytes_per_token(self) -> int:
        """Bytes of one token's hidden state in the checkpoint dtype: what a hop sends per token."""
        return self.hidden_size * self.dtype_bytes

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """Bytes of KV cache one token takes in ONE layer (keys + values)."""
        itemsize = torch_dtype(dtype or self.dtype).itemsize
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention + MLP or experts and router + two norms; biases ignored)."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * q_width + 2 * self.hidden_size * kv_width
        mlp = 3 * self.hidden_size * self.intermediate_size * max(1, self.num_experts)
        router = self.hidden_size * self.num_experts
        return attention + mlp + router + 2 * self.hidden_size

    def layer_bytes(self, dtype: str | None = None) -> int:
        """Bytes of weights of one decoder layer when loaded in `dtype` (default: the checkpoint's)."""
        return self.layer_params() * torch_dtype(dtype or self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Parse a dict from the wire/DHT; unknown keys are ignored, missing or bad ones raise ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"model spec must be a dict, got {type(data).__name__}")
        try:
            return cls(
                name=str(data["name"]),
                family=str(data["family"]),
                num_layers=int(data["num_layers"]),
                hidden_size=int(data["hidden_size"]),
                num_heads=int(data["num_heads"]),
                num_kv_heads=int(data["num_kv_heads"]),
                vocab_size=int(data["vocab_size"]),
                dtype=str(data["dtype"]),
                weights_hash=str(data["weights_hash"]),
                intermediate_size=int(data.get("intermediate_size", 0)),
                model_type=str(data.get("model_type", "llama")),
                head_size=int(data.get("head_size", 0)),
                num_experts=int(data.get("num_experts", 0)),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad model spec {data!r}: {e!r}") from e

    @classmethod
    def from_config(cls, config: Any, name: str, dtype: str, weights_hash: str) -> ModelSpec:
        """Build from a transformers config of a model of one of FAMILIES."""
        model_type = getattr(config, "model_type", "")
        if model_type not in FAMILIES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: FlowSwarm runs {', '.join(sorted(FAMILIES))}"
            )
        return cls(
            name=name,
            family=FAMILIES[model_type],
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            vocab_size=int(config.vocab_size),
            dtype=dtype,
            weights_hash=weights_hash,
            intermediate_size=int(config.intermediate_size),
            model_type=model_type,
            head_size=_head_size(config),
            num_experts=int(getattr(config, "num_local_experts", None) or 0),
        )


def _head_size(config: Any) -> int:
    """The config's head width where it is not hidden_size // num_attention_heads (Qwen3, Gemma 2), else 0."""
    head_dim = int(getattr(config, "head_dim", None) or 0)
    return 0 if head_dim * int(config.num_attention_heads) == int(config.hidden_size) else head_dim
