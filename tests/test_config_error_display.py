"""A config error is shown as its rules: IPython and Jupyter without the lab's frames, plain Python with one."""
from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import lab
from tests.config_draws import RecordingPool

ROOT = Path(__file__).resolve().parent.parent
BAD_LAYOUT = "import lab; lab.Parallel(dp=None, zero=2.0)"
RULE_LINES = ["ParallelConfigError: invalid config:", "  [positive-sizes] sizes must be positive ints: dp=None",
              "  [zero-stage] zero must be 0, 1, 2 or 3 (an int), got 2.0"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's lab, in the child too


def test_ipython_shows_a_config_error_as_its_rules_alone():
    done = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--colors=NoColor", "-c", BAD_LAYOUT],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    shown = (done.stdout + done.stderr).strip().splitlines()
    assert shown == RULE_LINES, shown


def test_jupyter_shows_a_config_error_as_its_rules_alone():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(BAD_LAYOUT)])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(ROOT)}}).execute(env=_env())
    [error] = [o for o in nb.cells[0].outputs if o.output_type == "error"]
    assert error.ename == "ParallelConfigError" and error.traceback == RULE_LINES, error


@pytest.mark.parametrize("make", [
    lambda: lab.Parallel(dp=None),
    lambda: lab.Experiment(RecordingPool(), lab.GPT(vocab=66), lab.Parallel(tp=4), steps=2.5),
], ids=["parallel", "experiment"])
def test_a_plain_traceback_shows_one_frame_of_the_lab(make):
    with pytest.raises(lab.ParallelConfigError) as err:
        make()
    frames = traceback.extract_tb(err.value.__traceback__)
    inside = [f for f in frames if {ROOT / "lab", ROOT / "kernels"} & set(Path(f.filename).parents)]
    assert inside == frames[-1:], frames  # only the frame that raised
