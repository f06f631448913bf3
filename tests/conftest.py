"""Shared fixtures. Tests run with one torch thread: the CI machine has 2 cores shared by everything."""

from __future__ import annotations

import os

os.environ.setdefault("FLOWSWARM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(int(os.environ["FLOWSWARM_THREADS"]))

# Property tests explore new inputs on every local run; under CI they draw the same inputs each time, so a
# submission's result does not depend on the seed (a failure found locally becomes a plain regression test).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_source():  # type: ignore[no-untyped-def]
    """The tiny seeded Llama (6 layers, hidden 64) as a ModelSource."""
    from swarm.models import resolve_model

    return resolve_model("tiny:0")


@pytest.fixture(scope="session")
def default_source():  # type: ignore[no-untyped-def]
    """The default SmolLM2-135M model (converted from its GGUF on first use, ~45 s once per machine)."""
    from swarm.models import resolve_model

    return resolve_model("default")
