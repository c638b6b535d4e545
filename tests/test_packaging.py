"""The project's shape holds: the contract loads light, the shadow guard, the console script, the wheel."""
from __future__ import annotations

import shutil
import subprocess
import zipfile
import sys
from pathlib import Path

import pytest

from lab._shadow_guard import ShadowedPackageError, check_own_packages

ROOT = Path(__file__).resolve().parent.parent


# The import rules themselves are import-linter contracts (tests/test_import_contracts.py); this checks
# what they cannot: importing a contract module at run time loads nothing heavy.
CONTRACT = sorted(f"kernels.contract.{p.stem}" for p in (ROOT / "kernels" / "contract").glob("*.py")
                  if p.stem != "__init__")


@pytest.mark.parametrize("module", CONTRACT)
def test_the_contract_modules_load_nothing_heavy(module):
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'numpy', 'lab', 'widgets') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


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
            "heavy = [m for m in ('torch', 'ipywidgets', 'widgets', 'lab.planning.planner') if m in sys.modules]; "
            "assert not heavy, heavy; lab.Parallel; assert 'lab.run.parallel' in sys.modules; "
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
