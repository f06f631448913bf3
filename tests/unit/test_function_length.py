"""No function in swarm/ or client/ is longer than 80 lines: a long function hides its steps, so name them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """'path:line name (N lines)' for every function or method in root's .py files longer than max_lines."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_checker_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n\n\ndef short():\n    return 1\n")
    found = long_functions(tmp_path)
    assert len(found) == 1 and "too_long" in found[0]


@pytest.mark.parametrize("package", ["swarm", "client"])
def test_no_function_is_longer_than_80_lines(package):
    assert long_functions(ROOT / package) == []
