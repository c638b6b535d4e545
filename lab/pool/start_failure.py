"""When a pool fails to start: what its processes printed, kept before their profile is removed.

ipyparallel sends each process's output (an engine's traceback included) to a log file in the
pool's private profile, which the lab deletes when it cleans up after a failed start; the error
would then say only "Engine set stopped ... exit_code 1". The lab reads the end of every
log first and puts it in the error, so the cause reaches the user (and CI's output).
"""
from __future__ import annotations

import ipyparallel as ipp

from lab.errors import LabError

OUTPUT_LINES = 15  # the end of a traceback, without a whole log


class PoolStartError(LabError):
    """The pool did not start; the message ends with the last lines each started process printed.

    ``engines_exited`` is True when engines died while starting (rather than not registering in time):
    ``lab.start`` then tries once more, with a ``PoolStartWarning`` that carries this message.
    """

    def __init__(self, message: str, *, engines_exited: bool) -> None:
        super().__init__(message)
        self.engines_exited = engines_exited


class PoolStartWarning(UserWarning):
    """Engines died while a pool started and the lab started it once more; the message says what they printed."""


def start_error(error: BaseException, cluster: ipp.Cluster) -> PoolStartError:
    """A ``PoolStartError`` for ``error`` raised while ``cluster`` started, with its processes' last output."""
    exited = isinstance(error, ipp.error.EngineError)
    what = "engines exited while the pool started" if exited else "the pool did not start"
    output = process_output(cluster)
    return PoolStartError(f"{what}: {type(error).__name__}: {error}" + (f"\n{output}" if output else ""),
                          engines_exited=exited)


def process_output(cluster: ipp.Cluster, lines: int = OUTPUT_LINES) -> str:
    """The last ``lines`` each engine printed, and the controller's when it stopped too, each under its name."""
    outputs = {}
    controller = cluster.controller
    if controller is not None and controller.state != "running":  # a live controller's log is its routine
        outputs["controller"] = controller.get_output()
    for engine_set in cluster.engines.values():
        per_engine = getattr(engine_set, "launchers", None)
        if per_engine is None:  # one process for the set (mpiexec): its output is every engine's
            outputs["engines"] = engine_set.get_output()
            continue
        # A local set moves each stopped engine's output from its launcher into ``outputs``.
        outputs.update({f"engine {i}": text for i, text in engine_set.outputs.items()})
        outputs.update({f"engine {i}": launcher.get_output() for i, launcher in per_engine.items()})
    tails = {name: "".join((text or "").splitlines(True)[-lines:]).rstrip() for name, text in outputs.items()}
    return "\n".join(f"--- {name} printed:\n{text}" for name, text in tails.items() if text)
