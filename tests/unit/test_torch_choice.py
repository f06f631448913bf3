"""scripts/torch_choice: which torch build ./scripts/setup installs, from a fake nvidia-smi on PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "torch_choice"


def choose(
    tmp_path: Path, nvidia_smi: str | None, forced: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the script with PATH holding only the system's tools and, when given, a fake nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\n" + nvidia_smi + "\n")
        fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if forced is not None:
        env["FLOWSWARM_TORCH"] = forced
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)


def test_cuda_where_nvidia_smi_lists_a_gpu(tmp_path: Path) -> None:
    result = choose(tmp_path, "echo 'NVIDIA GeForce RTX 4090, 550.54.14'")
    assert result.returncode == 0
    assert result.stdout == "cuda: nvidia-smi lists NVIDIA GeForce RTX 4090, driver 550.54.14\n"


def test_cpu_without_nvidia_smi(tmp_path: Path) -> None:
    if any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has a real nvidia-smi in /usr/bin or /bin")
    result = choose(tmp_path, None)
    assert result.returncode == 0
    assert result.stdout.startswith("cpu: no nvidia-smi on PATH")
    assert len(result.stdout.splitlines()) == 1


@pytest.mark.parametrize("broken", ["exit 9", "echo ''", "echo 'NVIDIA-SMI has failed' >&2; exit 6"])
def test_cpu_where_nvidia_smi_lists_nothing(tmp_path: Path, broken: str) -> None:
    result = choose(tmp_path, broken)
    assert result.returncode == 0
    assert result.stdout.startswith("cpu: nvidia-smi is installed but lists no GPU")


@pytest.mark.parametrize(("forced", "gpu"), [("cpu", True), ("cuda", False)])
def test_forced_either_way(tmp_path: Path, forced: str, gpu: bool) -> None:
    result = choose(tmp_path, "echo 'NVIDIA H200, 570.1'" if gpu else "exit 9", forced)
    assert result.returncode == 0
    assert result.stdout == f"{forced}: forced by FLOWSWARM_TORCH={forced}\n"


def test_bad_forced_value_fails(tmp_path: Path) -> None:
    result = choose(tmp_path, None, "rocm")
    assert result.returncode == 2
    assert "FLOWSWARM_TORCH must be cpu, cuda or auto" in result.stderr


def test_setup_uses_the_choice() -> None:
    """scripts/setup prints the choice and keys its stamp on it (a forced rerun is not skipped)."""
    setup = (SCRIPT.parent / "setup").read_text()
    assert "choice=$(scripts/torch_choice)" in setup
    assert 'echo "[setup] torch: $choice"' in setup
    assert '$torch_kind"' in setup.split("want=", 1)[1].splitlines()[0]
    assert os.access(SCRIPT, os.X_OK)
