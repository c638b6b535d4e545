"""The two ways to get a pool: start one on this machine, or attach to a running one."""
from __future__ import annotations

import functools
import os
import warnings

from kernels.watch.flight_recorder import BUFFER_ENV as FLIGHT_RECORDER_VARIABLE
from lab.pool import launch, launchers
from lab.pool.cluster import Cluster, default_rank_count
from lab.pool.start_failure import PoolStartError, PoolStartWarning

SPARES_VARIABLE = "CLUSTER_LAB_SPARE_ENGINES"  # a shared server's default: docs/teaching.md sets it to 0


def start(n: int | None = None, backend: str = "auto", threads_per_rank: int | None = None,
          timeout: float = 60.0, *, share_gpu: bool = False, controller_ip: str = "127.0.0.1",
          collective_timeout: float = 300.0, activate: bool = True, spare_engines: int | None = None,
          launcher: str = "local", flight_recorder: bool = True) -> Cluster:
    """Start ``n`` engines on this machine and build a torch.distributed world on them.

    Args:
        n: ranks; default one per visible GPU, or 4 CPU ranks when there is none.
        backend: "auto" (NCCL when every rank has its own GPU, else gloo), "nccl" or "gloo".
        share_gpu: with fewer GPUs than ranks, put the gloo ranks on the GPUs (round robin)
            instead of the CPU; the rank table's note says that timings include their contention.
        threads_per_rank: torch threads per rank; default 1, as torchrun sets (one thread per rank ran
            the lab's small models fastest: with 4 ranks on 16 cores, 4 threads each were 1.8-2.3x slower).
        timeout: seconds to wait for engines and for the process group to form.
        controller_ip: where the controller listens; loopback unless you need other hosts.
        collective_timeout: seconds a collective may wait before torch gives up.
        activate: point IPython's ``%%px`` at the ranks when running in IPython.
        spare_engines: engines kept started and warmed beside the ranks; a rank whose engine
            dies (or is killed, wedged) takes one over in about a second instead of the 3-4 s
            a fresh engine needs, so the error comes with the world already rebuilt. Default 1, or the
            ``CLUSTER_LAB_SPARE_ENGINES`` environment variable where it is set (a classroom server sets 0:
            a spare is a whole Python process with torch imported, about a fifth of a 4-rank pool's memory).
        launcher: "local" (one child process per engine) or "mpi" (all engines under one
            ``mpiexec``, through ipyparallel's MPI launcher; see ``lab.pool.launchers`` for the
            Open MPI flags it adds). Spares get an ``mpiexec`` of their own.
        flight_recorder: torch's ring of every process group's collectives, which a hang report reads
            (its per-group findings). False starts the engines, spares and restarts included, with
            ``TORCH_FR_BUFFER_SIZE=0``: no recorder, and a hang report without those findings, for a
            step with nothing of the lab's beside it. For ``connect``, set that variable where the
            engines start.

    Engines that die while starting are started once more, with a ``PoolStartWarning`` saying what they
    printed; a second failure raises ``PoolStartError`` with that output.

    Every process started here ends with this one, however it ends: SIGTERM or SIGHUP stop
    the pool as ``stop()`` does, and after a SIGKILL each process notices within seconds
    that its driver is gone (``lab.pool.lifetime``).
    """
    n = default_rank_count() if n is None else n
    if n < 1:
        raise ValueError(f"n must be at least 1 rank, got {n}")
    spare_engines = default_spare_engines() if spare_engines is None else spare_engines
    if spare_engines < 0:
        raise ValueError(f"spare_engines must be 0 or more, got {spare_engines}")
    launchers.check_launcher(launcher)
    if not isinstance(flight_recorder, bool):
        raise TypeError(f"flight_recorder must be True or False, got {flight_recorder!r}")
    # Like torchrun, cap each engine's OpenMP pool before it starts; torch threads are set again per rank.
    threads = threads_per_rank or 1
    engine_env = {"OMP_NUM_THREADS": str(threads)}
    if not flight_recorder:  # c10d reads it once, at the process's first group: it must be there at launch
        engine_env[FLIGHT_RECORDER_VARIABLE] = "0"
    start_local = functools.partial(launch.start_local, n, controller_ip=controller_ip, timeout=timeout,
                                    engine_env=engine_env, launcher=launcher)
    try:
        source = start_local()
    except PoolStartError as failure:
        if not failure.engines_exited:
            raise
        # Engines have died while starting once in CI, cause unknown; one more start is cheap beside a
        # failed lesson, and the warning keeps what they printed.
        warnings.warn(f"{failure}\nStarting the pool once more.", PoolStartWarning, stacklevel=2)
        source = start_local()
    return Cluster(source, backend=backend, share_gpu=share_gpu, threads_per_rank=threads_per_rank,
                   timeout=timeout, collective_timeout=collective_timeout, activate=activate,
                   spare_engines=spare_engines)


def default_spare_engines() -> int:
    """Spare engines when ``start`` is not told: ``CLUSTER_LAB_SPARE_ENGINES``, else 1."""
    value = os.environ.get(SPARES_VARIABLE, "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{SPARES_VARIABLE} must be a whole number of spare engines, got {value!r}") from None


def connect(profile: str | None = None, cluster_id: str | None = None, *, url_file: str | None = None,
            profile_dir: str | None = None, n: int | None = None, backend: str = "auto",
            share_gpu: bool = False, threads_per_rank: int | None = None, timeout: float = 60.0,
            collective_timeout: float = 300.0, activate: bool = True) -> Cluster:
    """Attach to engines started by ``ipcluster`` (local, MPI, SSH or Slurm launchers).

    Every engine becomes a rank. The lab never stops or kills these engines; it
    only builds (and on ``stop()`` tears down) the process group on them.
    ``n`` waits until that many engines have registered; ``share_gpu`` is as for :func:`start`.
    """
    source = launch.connect_existing(profile, cluster_id, url_file=url_file, profile_dir=profile_dir,
                                     n=n, timeout=timeout)
    return Cluster(source, backend=backend, share_gpu=share_gpu, threads_per_rank=threads_per_rank,
                   timeout=timeout, collective_timeout=collective_timeout, activate=activate)
