"""``swarm-peer join`` refuses at once what this machine cannot run (a GPU it cannot use, --quant without
bitsandbytes): one line naming the fix, exit 2, before the DHT, p2p or any weight load starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from swarm.testing import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# an initial peer nobody listens at: a join that got as far as the DHT would fail differently, or hang
NOWHERE = "/ip4/127.0.0.1/tcp/9/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
STARTED = ("resolving model", "joining the DHT", "loaded layers", "reachability")


def _join(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``swarm-peer join ARGS`` in a fresh interpreter, after running ``prelude`` there."""
    code = f"{prelude}\nimport sys\nfrom swarm.peer.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "join", "--initial-peers", NOWHERE, *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "FLOWSWARM_THREADS": "1", "PYTHONPATH": str(REPO)},
        cwd=REPO,
        start_new_session=True,
    )


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("swarm-peer: error:")]
    assert len(errors) == 1, result.stderr
    assert not any(step in result.stderr for step in STARTED), result.stderr
    return errors[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_cuda_without_a_usable_gpu_fails_at_once_naming_the_fix() -> None:
    line = _error_line(_join("--device", "cuda", "--model", "tiny"))
    if torch.version.cuda is None:  # the CPU build of torch
        assert "CPU build" in line and "FLOWSWARM_TORCH=cuda ./scripts/setup" in line, line
    else:
        assert "NVIDIA driver" in line, line


def test_quant_without_bitsandbytes_fails_at_once() -> None:
    # None in sys.modules makes `import bitsandbytes` raise ImportError, as where it is not installed
    line = _error_line(
        _join("--quant", "nf4", "--model", "tiny", prelude="import sys; sys.modules['bitsandbytes'] = None")
    )
    assert "--quant nf4 needs bitsandbytes" in line and "pip install" in line, line
