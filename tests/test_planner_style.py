"""The planner modules keep the rules of docs/design.md#house-style and stay free of torch (pure analytic code)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1] / "lab" / "planning"
MODULES = sorted([*LAB.glob("plan_*.py"), LAB / "planner.py", LAB / "recommend.py"])


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_planner_is_split_into_its_four_modules():
    names = {p.name for p in MODULES}
    assert {"planner.py", "recommend.py", "plan_models.py", "plan_math.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_planner_module_does_not_import_torch(path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "torch" for a in node.names), path.name
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "torch", path.name


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_planner_module_is_small_and_its_functions_short(path):
    tree = _tree(path)
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 500
    assert ast.get_docstring(tree), f"{path.name} needs a module docstring"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 50, f"{path.name}:{node.name} has {length} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_public_functions_are_typed_and_documented(path):
    for node in _tree(path).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            assert ast.get_docstring(node), f"{path.name}:{node.name} needs a docstring"
            assert node.returns is not None, f"{path.name}:{node.name} needs a return type"
            args = node.args.args + node.args.kwonlyargs
            assert all(a.annotation is not None for a in args), f"{path.name}:{node.name} untyped args"
