"""A notebook session whose cells fail on rank 1 in every way a user writes code; prints each error as JSON.

Run by ``test_frames_under_cloudpickle.py`` in a fresh interpreter, with one cloudpickle version first
on ``PYTHONPATH`` (the ranks inherit it), so that both the driver and the ranks use that version.
Argument: a directory for the module file registered to be sent by value.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import cloudpickle
from IPython.core.interactiveshell import InteractiveShell

import lab

CELLS = {
    "function": "def step(x):\n    if dist.get_rank() == 1:\n        return x / 0\n    return x\n",
    "nested": ("def outer():\n    def inner(y):\n        return 1 // (y - 1)\n"
               "    return inner(dist.get_rank())\n"),
    "lambda_in_function": "def apply():\n    f = lambda v: [0][v]\n    return f(dist.get_rank())\n",
    "helper": "def helper(v):\n    if v == 1:\n        raise KeyError(f'rank {v}')\n    return v\n",
    "spin": ("def spin():\n    import time\n    while dist.get_rank() == 1:\n        time.sleep(0.01)\n"
             "    dist.barrier()\n"),
}
CALLS = {
    "function": "cluster.run(step, 1)",
    "lambda": "cluster.run(lambda: 1 // (dist.get_rank() - 1))",
    "nested": "cluster.run(outer)",
    "lambda_in_function": "cluster.run(apply)",
    "px_cell": "%%px\nx = rank\nassert x != 1, f'rank {x} refuses'\n",
    "px_calls_pushed_function": "%%px\nhelper(rank)\n",
    "module_by_value": "cluster.run(userlib.fails)",
    "timeout_stack": "cluster.run(spin, timeout=4)",
}
MODULE = ("def fails():\n    import torch.distributed as dist\n    if dist.get_rank() == 1:\n"
          "        raise ValueError('from a module file')\n")


def main(module_dir: str) -> None:
    Path(module_dir, "userlib.py").write_text(MODULE)
    sys.path.insert(0, module_dir)
    import userlib

    cloudpickle.register_pickle_by_value(userlib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        cluster = lab.start(n=2, backend="gloo", spare_engines=0, activate=False)
    shell = InteractiveShell.instance()
    shell.user_ns.update(cluster=cluster, userlib=userlib)
    cluster.activate()
    shell.run_cell("import torch.distributed as dist")
    for source in CELLS.values():
        assert shell.run_cell(source).success
    cluster.push({"helper": shell.user_ns["helper"]})
    errors = {}
    for case, source in CALLS.items():
        error = shell.run_cell(source).error_in_exec
        errors[case] = {"type": type(error).__name__, "message": str(error),
                        "remote": getattr(error, "remote_traceback", "")}
    cluster.stop()
    print(json.dumps({"cloudpickle": cloudpickle.__version__, "module": userlib.__file__, "errors": errors}))


if __name__ == "__main__":
    main(sys.argv[1])
