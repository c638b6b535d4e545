"""Errors from real ranks name the user's cell, line and source under cloudpickle 3.1.2 and 3.1.3.

cloudpickle 3.1.3 renames the file of every code object it sends by value ("<dynamic-code>"); 3.1.2
keeps the notebook's own name. Each case runs ``notebook_errors_script.py`` in a fresh interpreter with
that cloudpickle version's wheel first on ``PYTHONPATH`` (the ranks inherit it), fetched from the
package index once per session. The script's cells fail on rank 1 as a function of a cell, a lambda, a
nested function, a lambda inside a function, a ``%%px`` cell, a pushed function called from ``%%px``,
a function of a module file sent by value, and a rank that never reaches a barrier (a timeout, whose
stack is dumped from C and carries no first line).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("notebook_errors_script.py")


@pytest.fixture(scope="session")
def cloudpickle_wheels(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("cloudpickle-wheels")
    for version in ("3.1.2", "3.1.3"):
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                  "--only-binary=:all:", "-d", str(where), f"cloudpickle=={version}"],
                                 capture_output=True, text=True, timeout=300)
        assert fetched.returncode == 0, f"pip could not fetch cloudpickle {version}:\n{fetched.stderr}"
    return where


@pytest.mark.slow  # two fresh interpreters, each starting a pool of its own
@pytest.mark.parametrize("version", ["3.1.2", "3.1.3"])
def test_every_kind_of_notebook_code_is_named_by_cell_and_line_with_source(version, cloudpickle_wheels, tmp_path):
    wheel = next(cloudpickle_wheels.glob(f"cloudpickle-{version}-*.whl"))  # a pure-Python wheel imports as a zip
    path = os.pathsep.join([str(wheel), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=400, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["cloudpickle"] == version
    errors = out["errors"]
    assert {e["type"] for case, e in errors.items() if case != "timeout_stack"} == {"RankError"}

    def shown(case: str) -> list[str]:
        lines = errors[case]["message"].splitlines()
        assert "dynamic-code" not in errors[case]["message"] and "not available" not in errors[case]["message"]
        return lines

    lines = shown("function")
    assert lines[1].startswith("  Cell In[") and lines[1].endswith("line 3, in step")
    assert lines[2].endswith("| def step(x):") and lines[4].startswith("  --> 3 |")
    assert lines[4].endswith("return x / 0")
    lines = shown("lambda")
    assert lines[1].endswith("line 1, in <lambda>")
    assert lines[2].endswith("cluster.run(lambda: 1 // (dist.get_rank() - 1))")
    lines = shown("nested")
    assert lines[1].startswith("  Cell In[") and lines[1].endswith("line 3, in inner")
    assert lines[4].endswith("return 1 // (y - 1)")
    lines = shown("lambda_in_function")
    assert lines[1].endswith("line 2, in <lambda>") and lines[3].endswith("f = lambda v: [0][v]")
    lines = shown("px_cell")
    assert lines[1].startswith('  File "<%%px cell ') and lines[1].endswith("line 2, in <module>")
    assert lines[3].endswith("assert x != 1, f'rank {x} refuses'")
    lines = shown("px_calls_pushed_function")
    assert lines[1].startswith("  Cell In[") and lines[1].endswith("line 3, in helper")
    assert lines[4].endswith("raise KeyError(f'rank {v}')")
    lines = shown("module_by_value")
    assert lines[1] == f'  File "{out["module"]}", line 4, in fails'
    assert lines[4].endswith("raise ValueError('from a module file')")
    timeout = errors["timeout_stack"]
    assert timeout["type"] == "RankTimeoutError"
    assert "Cell In[" in timeout["message"] and "time.sleep(0.01)" in timeout["message"]
    assert "dynamic-code" not in timeout["message"]
    # The whole remote traceback names the cell too, in IPython's own form.
    assert "Cell In[" in errors["function"]["remote"] and "dynamic-code" not in errors["function"]["remote"]
