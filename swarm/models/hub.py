"""Checkpoints named by a Hugging Face hub id (``--model ORG/NAME``): downloaded once, when the machine is
online, into FlowSwarm's model cache (``<cache>/models/hub/ORG--NAME``), and read from there ever after.

    path = fetch("HuggingFaceTB/SmolLM2-360M-Instruct")   # a local checkpoint dir, or ValueError saying why not

Only what a peer or client reads is fetched: configs, tokenizer files and safetensors weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from swarm.models import checkpoints

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
WANTED = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt"]


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as ORG/NAME and is no local path."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


def cached_dir(repo_id: str) -> Path:
    return checkpoints.models_dir() / "hub" / repo_id.replace("/", "--")


def fetch(repo_id: str) -> Path:
    """The checkpoint dir of hub model ``repo_id``, downloaded first if it is not in the cache yet."""
    final = cached_dir(repo_id)
    if (final / "config.json").is_file():
        return final
    try:
        _download(repo_id, final)
    except OSError:
        if (final / "config.json").is_file():  # another process (one peer per GPU) finished first: its copy
            return final
        raise
    return final


def _download(repo_id: str, final: Path) -> None:
    with checkpoints.atomic_dir(final) as tmp:
        try:
            from huggingface_hub import snapshot_download

            # consolidated*: Mistral repos' single-file copy of the same weights, beside the shards
            snapshot_download(
                repo_id, local_dir=tmp, allow_patterns=WANTED, ignore_patterns=["consolidated*"]
            )
        except Exception as e:  # offline, no such model, a gated one without a token, ...
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            raise ValueError(
                f"model {repo_id!r} is not in the cache ({final}) and could not be downloaded "
                f"({type(e).__name__}: {reason}); connect this machine to the internet (and unset "
                "HF_HUB_OFFLINE), or download the checkpoint elsewhere and pass its directory"
            ) from e
        if not (tmp / "config.json").is_file():
            raise ValueError(f"hub model {repo_id!r} has no config.json: not a transformers checkpoint")


__all__ = ["cached_dir", "fetch", "is_hub_id"]
