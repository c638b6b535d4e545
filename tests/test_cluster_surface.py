"""Only the pool package reaches into a Cluster: every other module uses its public surface
(``signal_ranks``, ``client``, ``timeout``, ``on_submit``, ``hold``, ``heard_from`` ...)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from lab.pool.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
POOL = ROOT / "lab" / "pool"


def private_names() -> set[str]:
    """The Cluster's own private names: its classes' methods and attributes, and what they set on ``self``."""
    names: set[str] = set()
    for cls in Cluster.__mro__:
        if cls.__module__.startswith("lab.pool"):
            names |= {n for n in vars(cls) if n.startswith("_") and not n.endswith("__")}
            for node in ast.walk(ast.parse(inspect.getsource(cls))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr) if node.attr.startswith("_") and not node.attr.endswith("__") else None
    return names


def reaches_in(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each ``obj._name`` in ``source`` for a Cluster private name, where ``obj`` is not ``self``."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_no_module_outside_the_pool_package_touches_a_clusters_private_state():
    private = private_names()
    assert {"_source", "_submit_listeners", "_heard", "_rank_map"} <= private  # the scan sees the internals
    outside = [p for top in ("lab", "widgets") for p in (ROOT / top).rglob("*.py") if POOL not in p.parents]
    offenders = [f"{path.relative_to(ROOT)}:{line} .{name}" for path in outside
                 for line, name in reaches_in(path.read_text(), private)]
    assert not offenders, offenders


def test_the_scan_catches_a_module_that_reaches_in():
    source = "def stop(run):\n    run.cluster._heard.clear()\n    return self._x, run.cluster._source.client\n"
    assert sorted(reaches_in(source, private_names())) == [(2, "_heard"), (3, "_source")]
