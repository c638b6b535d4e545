"""A process the lab starts exits when the process that started the pool (its driver) is gone.

The lab starts its controller and engines through this module: it arms a watchdog
thread, then runs the real program (``ipyparallel.engine`` or ``ipyparallel.controller``)
as ``__main__``, as ``python -m`` would. The watchdog checks the driver's PID twice a
second and ends this process once the driver has exited, however it died: SIGKILL,
out of memory, or a jupyter-server shutdown that gave up waiting. An engine's nanny
follows its engine by itself (it watches the engine's PID and pipe), ``mpiexec``
ends when its engines have, and a process forked from a watched one (the controller's
schedulers) is watched too.

Why a PID watchdog and not ``prctl(PR_SET_PDEATHSIG)``: the death signal follows the
*thread* that forked the child, not the process, and an engine under ``mpiexec`` is
not the driver's child at all; a PID is the one thing every launcher can pass on.
The driver's start time travels with its PID, so a PID reused by a later process
is never mistaken for the driver.

Run alone (ends when PID 12345, started at that time, is gone)::

    python -m kernels.engine.driver_watch 12345 1700000000.0 ipyparallel.engine --log-level=40
"""
from __future__ import annotations

import os
import runpy
import sys
import threading
import time

import psutil

CHECK_S = 0.5  # how often the driver's PID is checked; a driver's death is noticed within this


def driver_alive(pid: int, started: float) -> bool:
    """True while the process ``pid`` that started at ``started`` (``psutil`` create time) runs."""
    try:
        proc = psutil.Process(pid)
        # create_time is rounded differently across reads of /proc; a reused PID differs by far more
        return abs(proc.create_time() - started) < 0.5 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(pid: int, started: float, check_s: float = CHECK_S) -> None:
    """Block until the driver is gone, then end this process at once.

    ``os._exit`` because the main thread may be blocked inside a collective, where
    neither an exception nor a signal handler would run; nothing of a rank's state
    outlives its driver anyway.
    """
    while driver_alive(pid, started):
        time.sleep(check_s)
    os._exit(0)


def main(argv: list[str]) -> None:
    """``argv``: driver PID, driver start time, module to run, then that module's arguments."""
    pid, started, module, *args = argv

    def arm() -> None:
        threading.Thread(target=watch, args=(int(pid), float(started)), name="lab-driver-watch", daemon=True).start()

    arm()
    # A fork keeps only the forking thread: the controller forks its schedulers, and each needs a watch of its own.
    os.register_at_fork(after_in_child=arm)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
