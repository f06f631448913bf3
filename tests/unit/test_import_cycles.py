"""No import cycles among the project's modules, TYPE_CHECKING and function-local imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm", "client")

# Cycles still to untangle, each one strongly connected component (module names). The test fails on any cycle
# not listed here, and on a listed one that no longer exists, so the list only shrinks. Empty: keep it so.
KNOWN_CYCLES: set[frozenset[str]] = set()


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
    """Project modules `module` imports anywhere in its source (TYPE_CHECKING blocks and functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # `from pkg import sub` needs the submodule pkg.sub; `from pkg import name` needs pkg's __init__.
            source = _resolve(module, path, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else source)
    # Importing a.b.c runs the packages a and a.b first; that alone does not make a.b.c import them back:
    # only what a module names is an edge (else every package re-exporting its submodules would be a cycle).
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


def test_imports_are_read_everywhere_and_resolved_to_modules(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import x\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from pkg import b, name_in_init\n"
        "from . import c\n"
        "if TYPE_CHECKING:\n    from .d import D\n"
        "def f():\n    import pkg.e\n"
    )
    for name in "bcde":
        (package / f"{name}.py").write_text("")
    modules = {"pkg": package / "__init__.py", **{f"pkg.{n}": package / f"{n}.py" for n in "abcde"}}
    assert _imports("pkg.a", package / "a.py", modules) == {"pkg", "pkg.b", "pkg.c", "pkg.d", "pkg.e"}
    assert _imports("pkg", package / "__init__.py", modules) == {"pkg.a"}


def test_no_module_imports_one_that_imports_it_back() -> None:
    found = set(_cycles(_graph()))
    new = sorted(_describe(cycle) for cycle in found - KNOWN_CYCLES)
    gone = sorted(_describe(cycle) for cycle in KNOWN_CYCLES - found)
    assert not new, "import cycles:\n" + "\n".join(new)
    assert not gone, "listed cycles that no longer exist (remove them from KNOWN_CYCLES):\n" + "\n".join(gone)
