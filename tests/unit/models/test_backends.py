"""One seam per device: the backend is chosen from the device and dtype, the CPU's kernels are imported only
under swarm/models/backends/cpu/ (the factory names its backend class), and a range that does not run on the
CPU backend never loads them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from swarm.models.backends import for_device
from swarm.models.backends.cpu import CpuBackend
from swarm.models.backends.cuda import CudaBackend
from swarm.models.backends.generic import TorchBackend, TorchRange

ROOT = Path(__file__).resolve().parents[3]
CPU_PACKAGE = "swarm.models.backends.cpu"
FACTORY = ROOT / "swarm/models/backends/__init__.py"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_backend_follows_the_device_and_dtype() -> None:
    assert isinstance(for_device(torch.device("cpu"), torch.float32), CpuBackend)
    assert type(for_device(torch.device("cpu"), torch.bfloat16)) is TorchBackend
    assert isinstance(for_device(torch.device("cuda", 0), torch.float16), CudaBackend)


def test_the_cpu_kernels_are_imported_only_under_their_backend() -> None:
    outside = []
    for package in ("swarm", "client"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "swarm/models/backends/cpu") or path == FACTORY:
                continue
            if any(name == CPU_PACKAGE or name.startswith(f"{CPU_PACKAGE}.") for name in _imported(path)):
                outside.append(str(path.relative_to(ROOT)))
            for old in ("int4", "argmax", "matmul", "kept"):  # the modules' names before they moved
                if f"swarm.models.{old}" in _imported(path):
                    outside.append(str(path.relative_to(ROOT)))
    assert outside == []
    assert {n for n in _imported(FACTORY) if n.startswith(CPU_PACKAGE)} <= {
        CPU_PACKAGE,
        f"{CPU_PACKAGE}.CpuBackend",
    }


def test_a_range_off_the_cpu_backend_never_loads_the_cpu_kernels(tiny_source) -> None:  # type: ignore[no-untyped-def]
    """bfloat16 on a CPU runs the generic torch backend, as a GPU does: the CPU's modules stay unimported."""
    script = (
        "import sys, torch\n"
        "from swarm.models import Step, resolve_model\n"
        "source = resolve_model('tiny')\n"
        "blocks = source.load_blocks(0, 2, dtype='bfloat16', cache_tokens=16)\n"
        "head = source.load_head(dtype='bfloat16')\n"
        "out = blocks.forward([Step(None, head.embed(torch.tensor([1, 2, 3])), 0, 2, 0)])[0]\n"
        "head.logits(out, argmax_only=True)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({CPU_PACKAGE!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"
    assert type(tiny_source.load_blocks(0, 2, dtype="bfloat16").kernels) is TorchRange
