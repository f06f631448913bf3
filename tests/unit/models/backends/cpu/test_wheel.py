"""An installed wheel runs the same CPU kernels as a checkout: every C source is in the package data, and the
kernels compile and load from the installed package.

The wheel is built from this checkout (no build isolation: setuptools is already here, and nothing is
downloaded) and installed into a throwaway venv whose only way to torch and the other dependencies is a path
to this interpreter's site-packages; it then runs from a scratch directory without PYTHONPATH, so the checkout
cannot be imported by accident (the test checks where the modules came from).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from swarm.models.backends.cpu import int4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHECKOUT = Path(__file__).resolve().parents[5]
C_SOURCES = sorted(p.name for p in (CHECKOUT / "swarm/models/backends/cpu").glob("*.c"))

CHECK = """
import sys
import torch
from swarm.models.backends.cpu import argmax, int4
from swarm.testing.weights import four_bit
assert int4.__file__.startswith(sys.argv[1]), int4.__file__
assert argmax.FINISH_SOURCE.is_file() and int4.SOURCE.is_file()
assert int4.available() and argmax.exact_available() and argmax._finish() is not None
weight = four_bit(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)))
packed = int4.unpack(weight)
x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
torch.testing.assert_close(int4.product(x, packed, 64), x @ weight.T, atol=1e-5, rtol=1e-5)
print("kernels loaded from", int4.__file__)
"""


def _pip_wheel(tree: Path, out: Path) -> Path:
    """The wheel of a copy of the checkout (a build writes build/ and *.egg-info beside the sources)."""
    shutil.copytree(
        CHECKOUT,
        tree,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "node_modules"
        ),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            ".",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        if "No module named" in done.stderr and ("setuptools" in done.stderr or "pip" in done.stderr):
            pytest.skip(f"cannot build a wheel here: {done.stderr.strip()[-300:]}")
        raise AssertionError(f"pip wheel failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (wheel,) = out.glob("flowswarm-*.whl")
    return wheel


def test_the_wheel_ships_every_c_source_and_its_kernels_load_installed(tmp_path: Path) -> None:
    if int4.unsupported():
        pytest.skip(f"no CPU kernels on this machine: {int4.unsupported()}")
    assert C_SOURCES == ["int4.c", "screen.c"]
    wheel = _pip_wheel(tmp_path / "tree", tmp_path / "dist")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(name).name for name in archive.namelist() if name.endswith(".c")}
    assert shipped == set(C_SOURCES)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # its packages: the wheel's, installed below
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # the dependencies from this interpreter's site-packages, behind the venv's own (a path, not a site dir:
    # its .pth files, an editable install of the checkout among them, are not read)
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["FLOWSWARM_CACHE"] = str(tmp_path / "cache")  # compiled again, from the installed sources
    done = subprocess.run(
        [python, "-c", CHECK, str(site)], cwd=scratch, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.so"))
    assert compiled == ["int4", "screen"]
    shutil.rmtree(env_dir)
