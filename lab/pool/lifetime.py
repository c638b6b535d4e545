"""Nothing the lab starts outlives the process that started it (the driver: a kernel or a script).

Two halves, one for each way a driver ends:

- **It is told to end** (SIGTERM, SIGHUP: a kernel restart or shutdown from JupyterLab
  that escalates, a script stopped from the shell). Python's default for these
  signals ends the process at once, without ``atexit``, so the pool's clean-up never
  ran. ``stop_on_termination`` installs handlers that stop every pool of this
  process exactly as ``cluster.stop()`` does, then let the signal do what it did
  before (the previous handler, or the default: end the process).
- **It dies without a word** (SIGKILL, out of memory, a server that gave up waiting).
  Nothing runs in the driver then, so every process the lab starts watches the
  driver itself: its command goes through ``kernels.engine.driver_watch``, which ends it
  once the driver's PID is gone. Engines attached with ``lab.connect`` are started
  by someone else and never go through it.

The handlers are process-wide because signals are: the pools they stop are kept in
a weak set, so a pool that was stopped or dropped is not kept alive by it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from typing import Any, Protocol

import psutil
from traitlets.config import Config

TERMINATING = (signal.SIGTERM, signal.SIGHUP)
# The ipyparallel launcher classes whose commands the lab wraps, and the trait holding each command.
_COMMANDS = {"LocalControllerLauncher": ("controller_cmd", "ipyparallel.controller"),
             "LocalEngineSetLauncher": ("engine_cmd", "ipyparallel.engine"),
             "MPIEngineSetLauncher": ("engine_cmd", "ipyparallel.engine")}


class Stoppable(Protocol):
    """What the handlers stop: a ``lab.Cluster``."""

    def stop(self) -> None:
        """Stop the pool and every process the lab started for it."""


_pools: "weakref.WeakSet[Stoppable]" = weakref.WeakSet()
_previous: dict[int, Any] = {}  # signal -> the handler before the lab's, called after the pools stop


def watched_command(module: str) -> list[str]:
    """The command that runs ``python -m module`` and ends it when this process (the driver) is gone."""
    started = psutil.Process().create_time()
    return [sys.executable, "-m", "kernels.engine.driver_watch", str(os.getpid()), repr(started), module]


def watch_driver(config: Config) -> Config:
    """Make the controller and the engines (local or MPI, spares included) that ``config`` starts watch this process."""
    for launcher, (trait, module) in _COMMANDS.items():
        config[launcher][trait] = watched_command(module)
    return config


def stop_on_termination(pool: Stoppable) -> None:
    """Stop ``pool`` (``pool.stop()``) when this process gets SIGTERM or SIGHUP, before the signal takes effect.

    Handlers can only be installed from the main thread; a pool started on another
    thread is still covered by its processes' own watch on this driver.
    """
    _pools.add(pool)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in TERMINATING:
        current = signal.getsignal(sig)
        if current is not _on_termination:
            _previous[sig] = current
            signal.signal(sig, _on_termination)


def _on_termination(signum: int, frame: Any) -> None:
    for pool in list(_pools):
        try:
            pool.stop()
        except Exception:  # one pool failing to stop must not keep the others (or the signal) from going
            pass
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        # The default action (ending the process) needs the signal itself, delivered again with no handler.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
