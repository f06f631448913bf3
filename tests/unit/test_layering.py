"""The one-way flow of data, enforced: each layer imports only from itself and the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What each package may import from the project (besides itself). Vocabulary modules are importable everywhere.
VOCABULARY = {
    *("swarm", "swarm.types", "swarm.errors", "swarm.config", "swarm.settings", "swarm.wire", "swarm.codec"),
}
ALLOWED: dict[str, set[str]] = {
    "swarm.models": set(),
    "swarm.planner": set(),
    "swarm.routing": {"swarm.planner"},
    "swarm.dht": {"swarm.models"},
    "swarm.transport": {"swarm.models"},
    "swarm.peer": {"swarm.models", "swarm.dht", "swarm.transport", "swarm.planner", "swarm.routing"},
    "swarm.testing": {"swarm.dht", "swarm.models"},
    "swarm.sim": {"swarm.planner", "swarm.routing"},  # the simulator runs the live planner and router, no I/O
    "client": {"swarm.models", "swarm.dht", "swarm.transport", "swarm.routing", "swarm.planner"},
    # The web face is a client of the swarm built on client/; the client core never imports it.
    "client.web": {"client", "swarm.models", "swarm.dht", "swarm.transport", "swarm.routing"},
}


def _package_of(module: str) -> str | None:
    for package in sorted(ALLOWED, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return None


def _project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name == "swarm" or name.startswith(("swarm.", "client"))}


def _sources() -> list[tuple[str, Path]]:
    result = []
    for path in sorted([*(ROOT / "swarm").rglob("*.py"), *(ROOT / "client").rglob("*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if _package_of(module):
            result.append((module, path))
    return result


@pytest.mark.parametrize(("module", "path"), _sources(), ids=[m for m, _ in _sources()])
def test_imports_follow_the_layers(module: str, path: Path) -> None:
    own = _package_of(module)
    assert own is not None
    for imported in _project_imports(path):
        if imported in VOCABULARY or _package_of(imported) == own:
            continue
        target = _package_of(imported)
        assert target in ALLOWED[own], f"{module} imports {imported}: {own} may not depend on {target}"
