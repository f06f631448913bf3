"""Environment variables are read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted checkpoints and identities are cached (FLOWSWARM_CACHE, else ~/.cache/flowswarm)."""
    env = os.environ.get("FLOWSWARM_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flowswarm"
    base.mkdir(parents=True, exist_ok=True)
    return base


def torch_threads() -> int | None:
    """Threads for torch per process (FLOWSWARM_THREADS); None keeps torch's default."""
    env = os.environ.get("FLOWSWARM_THREADS")
    return int(env) if env else None


def fork_peers() -> bool:
    """Whether test swarms fork their peers from a process that has imported torch and hivemind already
    (FLOWSWARM_FORK_PEERS=1, set by scripts/test; swarm/testing/zygote.py), instead of starting each fresh."""
    return os.environ.get("FLOWSWARM_FORK_PEERS", "") == "1"


def log_level() -> str:
    return os.environ.get("FLOWSWARM_LOG", "INFO").upper()
