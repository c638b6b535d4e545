"""Which ipyparallel engine launcher starts the engines of a pool the lab owns.

``"local"`` starts each engine as a plain child process; ``"mpi"`` starts them all
with one ``mpiexec`` through ipyparallel's ``MPIEngineSetLauncher`` (each engine runs
``ipengine --mpi``, so mpi4py is initialised in it).
The torch.distributed world is built on top exactly as for local engines: MPI only
starts the processes, gloo or NCCL still carries the collectives.

Open MPI refuses two things this lab often does, so the lab asks for them explicitly:
running as root (``--allow-run-as-root``, the same as exporting
``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``) and more
processes than physical cores (``--oversubscribe``). It also pins each process to a
core by default, which would put every rank's torch threads on one core; the lab
passes ``--bind-to none`` and sets threads per rank itself, as for local engines.
"""
from __future__ import annotations

import importlib.util
import os
import shutil

import psutil
from traitlets.config import Config

LAUNCHERS = ("local", "mpi")


def check_launcher(launcher: str) -> str:
    """Return ``launcher`` if the lab can start engines with it; raise ValueError naming the choices.

    ``"mpi"`` also needs ``mpiexec`` on PATH and mpi4py importable by the engines,
    both checked here so that nothing is started when either is missing.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}; for ssh or slurm engines "
                         "start them with `ipcluster start --engines=ssh|slurm` and attach with lab.connect()")
    if launcher == "mpi":
        if shutil.which("mpiexec") is None:
            raise ValueError("launcher='mpi' needs mpiexec on PATH (Debian: apt-get install openmpi-bin)")
        # Looked up, not imported: importing mpi4py.MPI would initialise MPI in the driver.
        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError("launcher='mpi' needs mpi4py, which the engines import (pip install mpi4py, "
                             "or the project's [mpi] extra)")
    return launcher


def mpiexec_args(n: int) -> list[str]:
    """The Open MPI flags a lab-started ``mpiexec`` of ``n`` engines needs on this machine."""
    args = ["--bind-to", "none"]
    if os.geteuid() == 0:
        args.append("--allow-run-as-root")
    # Open MPI gives each physical core one slot and refuses to start more processes than slots.
    if n > (psutil.cpu_count(logical=False) or 1):
        args.append("--oversubscribe")
    return args


def engine_launcher_config(launcher: str, n: int, engine_env: dict[str, str]) -> tuple[str, Config]:
    """The ipyparallel engine launcher class name and its config for ``n`` engines with ``engine_env``.

    ``n`` sizes the mpiexec flags; spares started later by the same launcher are
    fewer, so the flags chosen for the ranks fit them too.
    """
    config = Config()
    if launcher == "mpi":
        config.MPIEngineSetLauncher.environment = dict(engine_env)
        config.MPIEngineSetLauncher.mpi_args = mpiexec_args(n)
        # `ipengine --mpi` asks the hub for its MPI rank as engine id, so a later mpiexec (spares,
        # replacements, restart) would get back the ids of engines just gone; the lab tells old
        # engines from new ones by id, so every engine takes the hub's next fresh id instead.
        config.MPIEngineSetLauncher.engine_args = ["--IPEngine.id=None"]
    else:
        config.LocalEngineSetLauncher.environment = dict(engine_env)
    return launcher, config  # ipyparallel takes the same short names
