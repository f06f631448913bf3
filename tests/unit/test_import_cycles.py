"""No import cycles among the project's modules, TYPE_CHECKING and function-local imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm", "client")

# Cycles in modules other owners are still untangling; each entry is one strongly connected component.
# The test fails on any cycle not listed here, and on a listed one that no longer exists (so the list only shrinks).
KNOWN_CYCLES: set[frozenset[str]] = {
    # swarm.models (owner: the models work of issue 51): the package's __init__ and its kernels import each other.
    frozenset(
        {
            "swarm.models",
            "swarm.models.argmax",
            "swarm.models.blocks",
            "swarm.models.head",
            "swarm.models.loading",
            "swarm.models.matmul",
        }
    ),
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `module` imports anywhere in its source; `from pkg import sub` counts `pkg.sub` too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            found.add(source)
            found.update(
                f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules
            )
    # Importing a.b.c runs a and a.b first, but those are the packages' own __init__ modules: count only the target.
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module, and modules importing themselves (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[frozenset[str]] = []

    def visit(root: str) -> None:
        # Iterative depth-first search: each frame is a module and the iterator over what it imports.
        frames = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while frames:
            node, targets = frames[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    frames.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            frames.pop()
            if frames:
                parent = frames[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    result.append(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return result


def _describe(cycle: frozenset[str]) -> str:
    return "{" + ", ".join(sorted(cycle)) + "}"


def test_the_detector_finds_cycles_and_self_loops() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert set(_cycles(graph)) == {frozenset({"a", "b", "c"}), frozenset({"e"})}


def test_no_module_imports_one_that_imports_it_back() -> None:
    found = set(_cycles(_graph()))
    new = sorted(_describe(cycle) for cycle in found - KNOWN_CYCLES)
    gone = sorted(_describe(cycle) for cycle in KNOWN_CYCLES - found)
    assert not new, "import cycles:\n" + "\n".join(new)
    assert not gone, "listed cycles that no longer exist (remove them from KNOWN_CYCLES):\n" + "\n".join(gone)
