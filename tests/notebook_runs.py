"""How CI runs a notebook: its exercises solved, top to bottom, the executed copy kept for the book."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from lab.course.exercises import solved

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ROOT / "build" / "executed"  # the static book is built from these (tests/test_book.py)
CELL_TIMEOUT_S = 90  # no single cell may take longer


def runnable_here(nb: nbformat.NotebookNode) -> bool:
    """False for a notebook that builds simulated hosts (``lab.needs_root``) when this process is not root."""
    return not nb.metadata.get("lab", {}).get("needs_root") or os.geteuid() == 0


def client(nb: nbformat.NotebookNode, path: Path) -> NotebookClient:
    """A kernel client for ``nb``, run from ``path``'s folder (relative paths as the notebook sees them)."""
    return NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}})


def execute(path: Path, notebook: nbformat.NotebookNode | None = None) -> nbformat.NotebookNode:
    """Run ``notebook`` (by default ``path`` with its exercises solved) in a fresh kernel beside ``path``.

    The executed copy is written to ``build/executed/`` even when a cell fails, so a broken run can be read.
    """
    nb = solved(path) if notebook is None else notebook
    try:
        client(nb, path).execute()
    finally:
        EXECUTED.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, EXECUTED / path.name)
    return nb
