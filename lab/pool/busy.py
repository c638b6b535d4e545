"""A pool training a run started with ``.start()`` is busy, and says so to the next cell.

Without this, a ``cluster.run`` or ``%%px`` sent while a started run trains sits in the
engines' queues behind it and blocks silently until training ends. Instead the call
waits in the open: one line naming the run (when it started, its step, how to end it)
and a bar that follows the run's steps; or, with ``wait=False``, it raises
``lab.PoolBusyError`` at once. Waiting is the default: in a class, a cell run too early
should simply run next, and the line says why it has not yet. An interrupt (Jupyter's
stop button) ends the wait only; the run goes on.

``PoolOccupancy`` is the part of ``lab.pool.cluster.Cluster`` that knows which run holds the
pool; ``lab.run.run_handle.RunHandle`` takes the pool (``hold``) for a started run and gives it back (``let_go``)
when the run ends. Calls from the run's own thread (its training call) pass.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from lab.errors import PoolBusyError

if TYPE_CHECKING:
    from lab.run.run_handle import RunHandle

WAIT_SLICE_S = 0.2  # how often a waiting call looks again (an interrupt is seen at once regardless)


def describe(run: "RunHandle") -> str:
    """ "the run started at 12:03:41 (step 17/40)": which run holds the pool, and how far it is."""
    steps = [r.step for r in run.progress if r is not None]
    done = min(steps) + 1 if len(steps) == run.world_size else 0
    return f"the run started at {time.strftime('%H:%M:%S', time.localtime(run.started_at))} " \
           f"(step {done}/{run.config['steps']})"


class PoolOccupancy:
    """Which started run holds the pool, if any (mixed into ``lab.pool.cluster.Cluster``)."""

    _occupant: "RunHandle | None" = None

    @property
    def busy(self) -> str | None:
        """What is running on the pool in the background (a started run, with its step), or None when free."""
        run = self._occupant
        return None if run is None or run.done else describe(run)

    def hold(self, run: "RunHandle") -> None:
        """``run`` holds the pool until ``let_go(run)``: calls from other threads wait for it meanwhile."""
        self._occupant = run

    def let_go(self, run: "RunHandle") -> None:
        """``run`` no longer holds the pool (nothing happens if another run holds it)."""
        if self._occupant is run:
            self._occupant = None

    def wait_until_free(self, wait: bool = True) -> None:
        """Return once no started run holds the pool (at once from that run's own thread).

        With ``wait=False`` raise ``PoolBusyError`` instead of waiting.
        """
        run = self._occupant
        if run is None or run.done or run._thread is threading.current_thread():
            return
        if not wait:
            raise PoolBusyError(f"the pool is busy with {describe(run)}: call its handle's stop() to end it, "
                                "wait() for it, or call again without wait=False to wait here", run)
        from lab.run.run_views import progress_bar

        print(f"waiting for {describe(run)}; its handle's stop() ends it", flush=True)
        with progress_bar(run, desc="the run before this cell"):
            while not run._finished.wait(WAIT_SLICE_S):
                pass
