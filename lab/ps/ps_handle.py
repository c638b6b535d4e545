"""A parameter-server run that does not block: what ``ParameterServer.start()`` returns.

The run is the same ``ParameterServer.run`` call, on a thread of its own. ``stop()`` asks
server 0 to let no worker start a new step (``kernels.ps.parameter_server.ShardServer.ask_stop``):
in sync mode every worker finishes the step under way, so all of them ran the same steps
and the losses still equal the reference's first steps; in async and bounded mode each
worker stops at its next pull. The servers then see every worker finish, RPC shuts down
as after any run, and the pool is ready for an ``Experiment``.

The stop goes as ``kernels.watch.progress.STOP_SIGNAL`` to rank 0's engine, whose handler is
installed before the run starts (a signal before that would end the engine).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kernels.watch.progress import STOP_SIGNAL, arm_stop

if TYPE_CHECKING:
    from lab.ps.parameter_server import ParameterServer
    from lab.ps.ps_result import PSResult


class PSHandle:
    """One parameter-server run under way: ``wait()``, ``done`` and ``stop()``."""

    def __init__(self, server: "ParameterServer", *, timeout: float | None = None) -> None:
        self.server = server
        self._result: "PSResult | None" = None
        self._error: BaseException | None = None
        server.cluster.run(arm_stop, ranks=[0])
        self._thread = threading.Thread(target=self._run, args=(timeout,), name="cluster-lab-ps-run", daemon=True)
        self._thread.start()

    def _run(self, timeout: float | None) -> None:
        try:
            self._result = self.server.run(timeout=timeout)
        except BaseException as error:  # raised again by wait(), on the caller's thread
            self._error = error

    @property
    def done(self) -> bool:
        """Whether the run has ended (finished, stopped or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> "PSResult":
        """Block until the run ends; return its ``PSResult`` or raise what the run raised."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the parameter-server run is still going after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def stop(self, wait: bool = True) -> "PSResult | None":
        """Let no worker start another step; with ``wait``, return the result of the steps that ran."""
        if not self.done:
            self.server.cluster.signal_ranks({0}, STOP_SIGNAL)
        return self.wait() if wait else None
