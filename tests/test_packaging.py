"""The project's shape holds: import boundaries, the shadow guard, the console script."""
from __future__ import annotations

import ast
import shutil
import subprocess
import zipfile
import sys
from pathlib import Path

import pytest

from lab._shadow_guard import ShadowedPackageError, check_own_packages

ROOT = Path(__file__).resolve().parent.parent


def imported_top_levels(package: str) -> dict[str, set[str]]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


# Rank-side modules the driver and the widgets may import: records and layout vocabulary, standard library only.
TORCH_FREE = ("kernels.records", "kernels.layout_rules", "kernels.config_rules", "kernels.run_config",
              "kernels.schedule_simulation")


def torch_free_modules() -> list[str]:
    return [m for m in TORCH_FREE if (ROOT / (m.replace(".", "/") + ".py")).exists()]


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports (``from a.b import c`` gives ``a.b``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if (ROOT / node.module.replace(".", "/")).is_dir():  # `from kernels import layout_rules`
                names |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                names.add(node.module)
    return names


def not_stdlib(path: Path) -> set[str]:
    """What a file imports beyond the standard library and the torch-free kernels modules."""
    return {m for m in imported_modules(path)
            if m.split(".")[0] not in sys.stdlib_module_names and m not in TORCH_FREE and m != "__future__"}


@pytest.mark.parametrize("package, forbidden", [("kernels", {"lab", "widgets"}), ("widgets", {"torch", "lab"})])
def test_layers_never_import_across_the_forbidden_lines(package, forbidden):
    offenders = {f: names & forbidden for f, names in imported_top_levels(package).items() if names & forbidden}
    assert not offenders, f"{package} must not import {sorted(forbidden)}: {offenders}"


def test_widgets_import_only_the_torch_free_kernels_modules():
    offenders = {str(p.relative_to(ROOT)): rank_code for p in (ROOT / "widgets").rglob("*.py")
                 if (rank_code := {m for m in imported_modules(p) if m.split(".")[0] == "kernels"} - set(TORCH_FREE))}
    assert not offenders, f"widgets may import only {TORCH_FREE} from kernels: {offenders}"


@pytest.mark.parametrize("module", torch_free_modules())
def test_torch_free_kernels_modules_import_only_the_standard_library(module):
    assert not not_stdlib(ROOT / (module.replace(".", "/") + ".py"))
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'numpy', 'lab', 'widgets') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_standard_library_check_catches_a_heavy_import(tmp_path):
    path = tmp_path / "records.py"
    path.write_text("import json\nfrom dataclasses import field\nimport numpy as np\nfrom torch import nn\n"
                    "from kernels.records import Record\nfrom kernels.model import GPT\n")
    assert not_stdlib(path) == {"numpy", "torch", "kernels.model"}


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


def test_the_wheel_holds_every_package_and_front_end_file_of_the_repo(tmp_path):
    # From a clean copy: setuptools would take a module left in the checkout's build/ from an earlier build.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            str(source), "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    with zipfile.ZipFile(next(tmp_path.glob("cluster_lab-*.whl"))) as wheel:
        shipped = set(wheel.namelist())
    own = {str(p.relative_to(ROOT)) for top in ("lab", "kernels", "widgets") for p in (ROOT / top).rglob("*")
           if p.suffix in (".py", ".js", ".css") and "__pycache__" not in p.parts}
    assert own and not own - shipped, f"left out of the wheel: {sorted(own - shipped)}"
