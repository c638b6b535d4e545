"""lab.start(launcher="mpi"): engines under one mpiexec (ipyparallel's MPI launcher) become ranks,
train like the reference, and are stopped by PID, the whole mpiexec tree with them."""
from __future__ import annotations

import os
import signal
import time
import warnings

import psutil
import pytest

import lab
from lab.pool import launchers
from tests.launcher_checks import alive, check_ranks_reduce_and_train, needs_mpi, rank_sum


def test_an_unknown_launcher_is_refused_before_anything_starts():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"launcher must be one of \('local', 'mpi'\), got 'slurm'.*ipcluster"):
        lab.start(2, launcher="slurm")
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_mpiexec_gets_the_open_mpi_flags_for_root_and_oversubscription():
    cores = psutil.cpu_count(logical=False) or 1
    assert "--oversubscribe" not in launchers.mpiexec_args(cores)
    assert "--oversubscribe" in launchers.mpiexec_args(cores + 1)
    assert ("--allow-run-as-root" in launchers.mpiexec_args(1)) == (os.geteuid() == 0)
    assert launchers.mpiexec_args(1)[:2] == ["--bind-to", "none"]


@pytest.mark.slow
def test_mpi_engines_become_ranks_train_like_the_reference_and_stop_by_pid():
    needs_mpi()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        pool = lab.start(4, launcher="mpi", activate=False, spare_engines=0, timeout=120)
    pool_pids_at_start = pool.pids
    try:
        mpiexec = [p for p in pool_pids_at_start if psutil.Process(p).name() == "mpiexec"]
        assert len(mpiexec) == 1
        under_mpiexec = {p.pid for p in psutil.Process(mpiexec[0]).children(recursive=True)}
        assert {r.pid for r in pool.rank_map.ranks} <= under_mpiexec <= pool.pids
        check_ranks_reduce_and_train(pool)
        # Open MPI ends the whole job when one process dies: every rank of the set goes with it,
        # the error names them all, and the next call runs on engines from a fresh mpiexec.
        victims = {r.pid for r in pool.rank_map.ranks}
        os.kill(pool.rank_map.ranks[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive(victims) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(victims) == [], "Open MPI should have ended the other engines of the job"
        with pytest.raises(lab.DeadRankError, match=r"ranks 0, 1, 2, 3 \(host .*\) died"):
            pool.run(rank_sum)
        assert pool.run(rank_sum) == [6.0] * 4
        assert not {r.pid for r in pool.rank_map.ranks} & victims
    finally:
        started = pool.pids
        pool.stop()
    assert alive(started) == []
