"""The curriculum runs top to bottom, exercises solved, and notebooks in git carry no outputs."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from tests.jupyter_browser import require_browser
from tests.notebook_runs import NOTEBOOKS, execute, runnable_here
# Notebooks a real-browser test already runs to their last cell's check (a failing assert is a traceback there).
BROWSER_RUNS = {"05_pipeline_parallel.ipynb": "tests/test_browser_notebook05.py"}


def browser_ready() -> bool:
    """Chromium and Playwright are here, so the browser tests run rather than skip."""
    try:
        require_browser()
    except pytest.skip.Exception:
        return False
    return True


def test_the_notebooks_folder_holds_the_curriculum():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_in_git_has_no_outputs_or_execution_counts(path):
    cells = json.loads(path.read_text())["cells"]
    dirty = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.slow  # executing the eight notebooks is about 40% of the suite
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_and_its_last_cell_checks_theory(path):
    nb = nbformat.read(path, as_version=4)
    if not runnable_here(nb):
        pytest.skip(f"{path.name} builds simulated hosts: network namespaces, veths and tc need root")
    if path.name in BROWSER_RUNS and browser_ready():
        pytest.skip(f"{path.name} runs top to bottom, to its last check, in Chromium: {BROWSER_RUNS[path.name]}")
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    assert "assert" in last.source, f"{path.name}: the last code cell must assert measured vs theory"
    nb = execute(path)  # with every exercise's solution filled in (tests/test_course_exercises.py runs the blanks)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]  # discussion questions may follow it, in markdown
    outputs = [o for o in last.get("outputs", []) if o.get("output_type") == "stream"]
    assert outputs, f"{path.name}: the last cell printed nothing"
