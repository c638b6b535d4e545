"""Functions defined in a notebook (``__main__``) reach the ranks with the globals they read.

A notebook's functions live in ``__main__``. Without cloudpickle, ipyparallel sends such a function
as bare code and runs it on the rank's namespace, where the notebook's variables and imports are
missing (NameError). The fast tests build the functions in a namespace named ``__main__``, as a
notebook cell does; the slow one runs a real script, whose functions are in the real ``__main__``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ipyparallel as ipp
import pytest

# Each name below exists only in this "notebook": the ranks never bind json, cfg or scaled.
NOTEBOOK = '''
import json
cfg = {"lr": 0.5, "name": "run-a"}
read_cfg = lambda: cfg["name"]
dumps_on_rank = lambda: json.dumps({"rank": rank})
def scaled(x):
    return x * cfg["lr"]
def calls_scaled():
    return scaled(4)
def reads_rank_names():
    return rank, world, greeting
'''


def notebook(source: str) -> dict:
    """Run ``source`` as a notebook cell would: in a namespace whose ``__name__`` is ``__main__``."""
    namespace = {"__name__": "__main__"}
    exec(source, namespace)
    return namespace


@pytest.fixture(scope="module")
def nb():
    namespace = notebook(NOTEBOOK)
    assert namespace["read_cfg"].__module__ == "__main__"  # what makes them notebook functions
    return namespace


def test_closure_over_a_notebook_dict_reaches_every_rank(cluster, nb):
    assert cluster.run(nb["read_cfg"]) == ["run-a"] * 4


def test_a_module_imported_in_the_notebook_only_is_usable_on_the_ranks(cluster, nb):
    assert cluster.run(nb["dumps_on_rank"]) == [json.dumps({"rank": r}) for r in range(4)]


def test_a_notebook_function_may_call_another_notebook_function(cluster, nb):
    assert cluster.run(nb["calls_scaled"], ranks=[1, 3]) == {1: 2.0, 3: 2.0}


def test_names_bound_only_on_the_ranks_still_resolve_and_the_notebook_wins_a_clash(cluster, nb):
    cluster.push({"greeting": "hi"})
    assert cluster.run(nb["reads_rank_names"]) == [(r, 4, "hi") for r in range(4)]
    clash = notebook("greeting = 'from the notebook'\nread = lambda: greeting")
    assert cluster.run(clash["read"]) == ["from the notebook"] * 4


def test_a_pushed_value_is_passed_by_name_and_a_pushed_function_keeps_its_globals(cluster, nb):
    cluster.push({"table": list(range(100)), "pushed_fn": nb["calls_scaled"]})
    assert cluster.pull("table", ranks=[2]) == {2: list(range(100))}
    total = notebook("total = lambda t: sum(t)")["total"]
    assert cluster.run(total, ipp.Reference("table")) == [4950] * 4
    everyone = cluster.client[[r.engine_id for r in cluster.rank_map.ranks]]
    everyone.execute("pushed_out = pushed_fn()", block=True)  # what a %%px cell does
    assert cluster.pull("pushed_out") == [2.0] * 4


SCRIPT = '''
import json, warnings
import lab

cfg = {"x": 3}
def helper(v):
    return v * 2
def task():
    return json.dumps([cfg["x"], helper(cfg["x"]), rank])

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    cluster = lab.start(n=1, backend="gloo", activate=False, timeout=120)
try:
    before = cluster.run(task)
    cluster.restart()  # new engines: nothing set on the old ones may be needed
    print(json.dumps([before, cluster.run(task)]))
finally:
    cluster.stop()
'''


@pytest.mark.slow  # starts a pool of its own in a subprocess, then restarts it
def test_a_script_s_main_functions_reach_the_ranks_before_and_after_restart():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert before == after == [json.dumps([3, 6, 0])]
