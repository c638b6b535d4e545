"""The project's shape holds: import boundaries, the shadow guard, the console script."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from lab._shadow_guard import ShadowedPackageError, check_own_packages

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Dotted names of the absolute imports in one file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def imported_top_levels(package: str) -> dict[str, set[str]]:
    return {str(path.relative_to(ROOT)): {n.split(".")[0] for n in imported_modules(path)}
            for path in (ROOT / package).rglob("*.py")}


def torch_free(module: str) -> bool:
    """True when a kernels module and every kernels module it imports import no torch."""
    names = imported_modules(ROOT / (module.replace(".", "/") + ".py"))
    tops = {n.split(".")[0] for n in names}
    return "torch" not in tops and all(torch_free(n) for n in names if n.startswith("kernels."))


@pytest.mark.parametrize("package, forbidden", [("kernels", {"lab", "widgets"}), ("widgets", {"torch", "lab"})])
def test_layers_never_import_across_the_forbidden_lines(package, forbidden):
    offenders = {f: names & forbidden for f, names in imported_top_levels(package).items() if names & forbidden}
    assert not offenders, f"{package} must not import {sorted(forbidden)}: {offenders}"


def test_widgets_import_only_torch_free_kernels_modules():
    # The views share the layout vocabulary and the schedule simulation with the ranks, never torch.
    used = {n for path in (ROOT / "widgets").rglob("*.py") for n in imported_modules(path) if n.startswith("kernels")}
    assert "kernels" not in used, "import a kernels module by name, not the package"
    offenders = sorted(n for n in used if not torch_free(n))
    assert not offenders, f"widgets import kernels modules that need torch: {offenders}"


def test_guard_accepts_this_checkout():
    check_own_packages()


def test_guard_rejects_packages_resolved_elsewhere(tmp_path):
    with pytest.raises(ShadowedPackageError, match="shadows it"):
        check_own_packages(root=tmp_path)


def test_import_lab_names_the_package_that_shadows_kernels(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    done = subprocess.run([sys.executable, "-c", "import lab"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0
    assert "ShadowedPackageError" in done.stderr and str(tmp_path / "kernels") in done.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme and "python -m pytest" in ci.splitlines()[-1]
    assert ci.index("torch==2.13.0") < ci.index('-e ".[test]"')


def test_import_lab_imports_nothing_heavy_until_a_name_is_used():
    # Engines import the module of every function they run; a module that does `import lab`
    # must not make them import torch, widgets or the planner.
    code = ("import sys, lab; "
            "heavy = [m for m in ('torch', 'ipywidgets', 'widgets', 'lab.planner') if m in sys.modules]; "
            "assert not heavy, heavy; lab.Parallel; assert 'lab.parallel' in sys.modules; "
            "assert set(lab.__all__) <= set(dir(lab)); lab.GPT(layers=1)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
