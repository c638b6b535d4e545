"""The lab's ``%px`` and ``%%px`` magics: a notebook cell run on every rank that behaves like a cell.

ipyparallel's own magics hand back an AsyncResult, which JupyterLab shows as
``<AsyncResult(%px): pending>``; a rank's error is never shown, and ranks left
waiting in a collective block the next cell. These magics run the cell through
``Cluster.run`` (with ``kernels.engine.cell.run_cell`` on each rank), so that:

- when the cell ends, each rank's stdout, stderr, displays and final value are shown in
  rank order, each line labelled ``[rank r]``;
- a rank that raises gives the same :class:`~lab.errors.RankError` as ``cluster.run``
  (the cause first, its host and remote traceback), shown after what every rank wrote
  up to then, and the world is rebuilt, so the next cell works;
- ``%%px --timeout S`` interrupts the ranks still running after S seconds and raises
  :class:`~lab.errors.RankTimeoutError` (ipyparallel's magics have no timeout: ipyparallel
  issue #435); ``%%px --ranks 0,2`` runs on some ranks only;
- while a run started with ``.start()`` trains, the cell waits for it, saying so
  (``lab.pool.busy``); ``%%px --no-wait`` raises :class:`~lab.errors.PoolBusyError` instead.

``Cluster.activate()`` binds the magics to a pool; ``lab.start()`` does it when run in IPython.
"""
from __future__ import annotations

import argparse
import linecache
import sys
import weakref
from typing import TYPE_CHECKING, TextIO

from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from kernels.engine import cell
from kernels.contract.pool_records import CellOutput
from lab.errors import LabError, PoolStoppedError, RankError

if TYPE_CHECKING:
    from lab.pool.cluster import Cluster

OUTPUT_FETCH_TIMEOUT_S = 10.0  # fetching what ranks wrote before an error; they are idle by then


def register(cluster: "Cluster") -> None:
    """Make ``%px``/``%%px`` in the running IPython shell run on ``cluster``'s ranks."""
    shell = get_ipython()
    if shell is None:
        raise LabError("%px needs IPython (a notebook or the ipython shell); elsewhere use cluster.run(fn)")
    shell.register_magics(PxMagics(shell, cluster))


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ranks takes rank numbers separated by commas, e.g. 0,2; got {text!r}") from None
    if len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"--ranks names a rank twice: {text!r}")
    return ranks


@magics_class
class PxMagics(Magics):
    """``%px`` and ``%%px`` bound to one pool (held weakly: the magics never keep a pool alive)."""

    def __init__(self, shell: object, cluster: "Cluster") -> None:
        super().__init__(shell)
        self._cluster = weakref.ref(cluster)

    @line_magic("px")
    def px_line(self, line: str) -> None:
        """Run one line on every rank, e.g. ``%px print(rank, device)``."""
        __tracebackhide__ = True
        self.run(line)

    @magic_arguments("%px")  # IPython adds one more "%" in the usage line
    @argument("--timeout", type=float, default=None, metavar="SECONDS",
              help="interrupt the ranks still running after this many seconds (RankTimeoutError); "
                   "the world is rebuilt")
    @argument("--ranks", type=_rank_list, default=None, metavar="R,R",
              help="run on these ranks only, e.g. --ranks 0,2")
    @argument("--no-wait", action="store_true",
              help="while a started run trains, raise PoolBusyError instead of waiting for it")
    @cell_magic("px")
    def px_cell(self, line: str, source: str) -> None:
        """Run the cell on the ranks; each rank's output is shown, labelled by rank, when the cell ends."""
        __tracebackhide__ = True
        args = parse_argstring(self.px_cell, line)
        self.run(source, ranks=args.ranks, timeout=args.timeout, wait=not args.no_wait)

    def run(self, source: str, *, ranks: list[int] | None = None, timeout: float | None = None,
            wait: bool = True) -> None:
        """Run IPython ``source`` on ``ranks`` (all by default) and show what each rank wrote."""
        __tracebackhide__ = True  # IPython leaves this frame out of the error it shows for the cell
        if timeout is not None and not timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {timeout:g}")
        cluster = self._cluster()
        if cluster is None:
            raise PoolStoppedError("the pool %px was bound to is gone; start one with lab.start()")
        code = self.shell.transform_cell(source)  # IPython syntax (%magics, !commands) becomes Python
        name = f"<%%px cell {self.shell.execution_count}>"
        compile(code, name, "exec")  # a syntax error is raised here, before anything runs on a rank
        # The ranks' frames name the cell; its lines live here, for the error to show them.
        linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
        try:
            outputs = cluster.run(cell.run_cell, code, name, ranks=ranks, timeout=timeout, wait=wait)
        except RankError as error:
            show(_outputs_before_error(cluster, ranks))
            # The driver's frames (this magic, cluster.run, the recovery) say nothing about the
            # cell; the error's message carries the failing rank's own traceback.
            raise error.with_traceback(None)
        show(dict(outputs) if ranks is not None else dict(enumerate(outputs)))


def _outputs_before_error(cluster: "Cluster", ranks: list[int] | None) -> dict[int, CellOutput]:
    """What each rank's cell wrote before the call failed; empty where a rank died or was replaced."""
    try:
        taken = cluster.run(cell.take_last_output, ranks=ranks, timeout=OUTPUT_FETCH_TIMEOUT_S)
    except LabError:  # a dead rank: the pool refuses calls until restart(), and the error says so
        return {}
    by_rank = taken if isinstance(taken, dict) else dict(enumerate(taken))
    return {rank: out for rank, out in by_rank.items() if out is not None}


def show(outputs: dict[int, CellOutput]) -> None:
    """Write each rank's output in rank order: stdout, stderr, displays, then the cell's value."""
    for rank in sorted(outputs):
        out, label = outputs[rank], f"[rank {rank}]"
        _write_lines(sys.stdout, label, out.stdout)
        _write_lines(sys.stderr, label, out.stderr)
        for bundle in out.displays:
            _show_bundle(label, bundle)
        if out.value is not None:
            _show_bundle(f"{label} Out:", out.value)


def _write_lines(stream: TextIO, label: str, text: str) -> None:
    if text:
        stream.write("".join(f"{label} {line}\n" for line in text.splitlines()))
        stream.flush()


def _show_bundle(label: str, bundle: dict[str, object]) -> None:
    text = str(bundle.get("text/plain", ""))
    if set(bundle) != {"text/plain"}:  # rich output (HTML, images): the label, then the output itself
        print(label)
        display(bundle, raw=True)
    elif "\n" in text:  # a multi-line repr keeps its own alignment below the label
        print(f"{label}\n{text}")
    else:
        print(f"{label} {text}")
