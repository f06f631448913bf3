"""Tiny random checkpoints of the families that are not the Llama block (Qwen3, Mixtral, Gemma 2 and 3), written by
transformers itself, for exactness tests and local swarms.

    path = write_tiny_family(tmp_path / "qwen3", "qwen3")   # an HF dir: resolve_model(str(path)) loads it

Weights come from a seeded generator of our own and are scaled so that activations stay near unit size: norms
near their identity, projections ~ 1/sqrt(fan-in), so routers choose distinct experts and logits have a clear top.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 320
GEMMA2_WINDOW = 8  # Gemma 2's and 3's window, shorter than the tests' sequences: windowed layers drop keys

_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # never stop early: tests compare fixed-length generations
    pad_token_id=0,
)

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    # a head wider than hidden / heads (32, not 16), as Qwen3's checkpoints have
    "qwen3": dict(_COMMON, num_hidden_layers=6, intermediate_size=96, head_dim=32, tie_word_embeddings=False),
    "mixtral": dict(
        _COMMON,
        num_hidden_layers=6,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    # soft-caps low enough to bend these weights' logits; alternating sliding (8 tokens) and full layers
    "gemma2": dict(
        _COMMON,
        num_hidden_layers=6,
        intermediate_size=96,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=GEMMA2_WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=1.0,
        tie_word_embeddings=True,
    ),
    # layers alternating sliding and full, each kind with its own RoPE base (transformers' defaults: 1e4, 1e6)
    "gemma3_text": dict(
        _COMMON,
        num_hidden_layers=6,
        intermediate_size=96,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=GEMMA2_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 3,
        tie_word_embeddings=True,
    ),
}

# model_type -> (config class, model class) in transformers
_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def tiny_family_model(model_type: str, seed: int = 0) -> Any:
    """A tiny *ForCausalLM of ``model_type`` (a key of FAMILY_CONFIGS) with seeded weights, in float32."""
    import transformers

    config_class, model_class = _CLASSES[model_type]
    config = getattr(transformers, config_class)(**FAMILY_CONFIGS[model_type])
    model = getattr(transformers, model_class)(config)
    generator = torch.Generator().manual_seed(seed)
    zero_centred = model_type.startswith("gemma")  # Gemma's RMSNorm multiplies by (1 + weight)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_((0.0 if zero_centred else 1.0) + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise * (0.05 if zero_centred else 1.0))  # Gemma's are scaled up by sqrt(hidden)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.eval()


def write_tiny_family(out: Path, model_type: str, seed: int = 0) -> Path:
    """Write ``tiny_family_model(model_type, seed)`` as an HF checkpoint dir ``out``; returns ``out``."""
    tiny_family_model(model_type, seed).save_pretrained(out)
    return out


__all__ = ["FAMILY_CONFIGS", "GEMMA2_WINDOW", "tiny_family_model", "write_tiny_family"]
