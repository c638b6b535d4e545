"""The architecture, checked: import-linter's contracts (pyproject.toml, [tool.importlinter]) hold,
a broken import is caught by the contract it breaks, and the folders say what they hold."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lab", "kernels", "widgets")
MAX_TOP_LEVEL_FILES = 12
# lab.testing is a test rig, never imported by an engine; ``from lab.testing import hosts`` must
# give the function, not its module of the same name, so its __init__ imports it.
RIGS = {"lab/testing/__init__.py"}


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the packages and pyproject.toml under ``root`` (no cache left behind)."""
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True)


def test_the_import_contracts_hold():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.fixture
def copy_of_the_repo(tmp_path: Path) -> Path:
    """The Python files of the three packages and pyproject.toml, where a test may break them."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("static", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize("importer, line, contract", [
    ("kernels/engine/cell.py", "from lab.errors import LabError", "kernels import no lab"),
    ("widgets/cluster_view.py", "import torch", "widgets import only"),
    ("widgets/cluster_view.py", "from kernels.engine import runtime", "widgets import only"),
    ("kernels/contract/records.py", "import torch", "kernels.contract imports no torch"),
    ("lab/planning/plan_math.py", "from kernels.model import gpt", "lab.planning imports no torch"),
    # an upward import in a __main__ block counts too
    ("kernels/model/gpt.py", "if __name__ == '__main__':\n    from kernels.train import entry", "kernels layers"),
], ids=["kernels->lab", "widgets->torch", "widgets->engine", "contract->torch", "planning->model", "model->train"])
def test_a_broken_import_is_caught_by_the_contract_it_breaks(copy_of_the_repo: Path, importer: str, line: str,
                                                             contract: str):
    path = copy_of_the_repo / importer
    path.write_text(path.read_text() + f"\n{line}\n")
    done = lint_imports(copy_of_the_repo)
    assert done.returncode != 0, done.stdout
    broken = [row for row in done.stdout.splitlines() if row.endswith("BROKEN")]
    assert any(row.startswith(contract) for row in broken), done.stdout  # torch in the contract breaks widgets' too


def test_the_contract_imports_only_the_standard_library():
    graph = grimp.build_graph("kernels", include_external_packages=True, cache_dir=None)
    outside = {(m, i) for m in graph.modules if m.startswith("kernels.contract")
               for i in graph.find_modules_directly_imported_by(m)
               if not i.startswith("kernels.contract") and i.split(".")[0] not in sys.stdlib_module_names}
    assert not outside, outside


def import_circles(graph: grimp.ImportGraph) -> set[tuple[str, str]]:
    """Pairs of modules (sorted) that each import the other, directly or through others, at run time."""
    return {tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
            if graph.find_shortest_chain(importer=b, imported=a)}


def test_no_module_imports_itself_through_others_at_run_time():
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None,
                              exclude_type_checking_imports=True)  # a type hint's import never runs
    circles = import_circles(graph)
    assert not circles, circles


def test_the_circle_check_sees_a_lazy_import_inside_a_function(copy_of_the_repo: Path, monkeypatch):
    path = copy_of_the_repo / "kernels" / "contract" / "records.py"
    path.write_text(path.read_text() + "\n\ndef _demo():\n    from kernels.contract import run_config\n")
    monkeypatch.syspath_prepend(str(copy_of_the_repo))
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        monkeypatch.delitem(sys.modules, name)
    graph = grimp.build_graph("kernels", include_external_packages=False, cache_dir=None,
                              exclude_type_checking_imports=True)
    assert ("kernels.contract.records", "kernels.contract.run_config") in import_circles(graph)


@pytest.mark.parametrize("package", ["lab", "kernels"])
def test_each_package_holds_few_top_level_files_and_subpackages_that_say_what_they_are(package: str):
    top = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_FILES, top
    for init in (ROOT / package).glob("*/__init__.py"):
        if str(init.relative_to(ROOT)) in RIGS:
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} has no docstring saying what the folder holds"
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not imports, f"{init.relative_to(ROOT)} imports: importing a package must stay light on the engines"
