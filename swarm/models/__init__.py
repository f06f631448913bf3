"""The model layer: checkpoints, the block ranges peers run, and the head clients keep.

from swarm.models import resolve_model, Step, SamplingParams
source = resolve_model("default")                 # or "tiny[:SEED]" or an HF checkpoint dir
blocks = source.load_blocks(0, 10, cache_tokens=8192)
head = source.load_head()
"""

from swarm.models.blocks import BlockRange, Step
from swarm.models.head import ClientHead, Sampler, SamplingParams
from swarm.models.loading import DEFAULT_CACHE_TOKENS, ModelSource, parse_device, resolve_model
from swarm.models.spec import ModelSpec, dtype_name, torch_dtype

__all__ = [
    "DEFAULT_CACHE_TOKENS",
    "BlockRange",
    "ClientHead",
    "ModelSource",
    "ModelSpec",
    "Sampler",
    "SamplingParams",
    "Step",
    "dtype_name",
    "parse_device",
    "resolve_model",
    "torch_dtype",
]
