"""lab.connect attaches to engines that ``ipcluster start`` ran under mpiexec and under a one-node
Slurm; they become ranks, all_reduce and train DP2xTP2 like the reference. ``ipcluster stop``
then leaves no process and no Slurm job."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from lab.pool import launchers
from tests.ipcluster_server import connect_when_ready, ipcluster
from tests.launcher_checks import check_ranks_reduce_and_train, needs_mpi

SLURM_SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "slurm_single_node.sh"

# What `ipcluster start --engines=mpi` needs from Open MPI here (README "More than one machine").
MPI_CONFIG = (f"c.MPIEngineSetLauncher.mpi_args = {launchers.mpiexec_args(4)!r}\n"
              'c.MPIEngineSetLauncher.engine_args = ["--IPEngine.id=None"]\n')


@pytest.mark.slow
def test_connect_to_ipcluster_mpi_engines(tmp_path):
    needs_mpi()
    with ipcluster(tmp_path, "mpi", 4, MPI_CONFIG) as profile_dir:
        pool = connect_when_ready(profile_dir, 4, timeout=180)
        try:
            check_ranks_reduce_and_train(pool)
        finally:
            pool.stop()


def slurm_jobs() -> list[str]:
    """Job ids Slurm still knows as pending or running."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm started by the repo's script (skipped with the script's reason where it cannot)."""
    if os.geteuid() != 0:
        pytest.skip("a one-node Slurm needs root: .ci/slurm_single_node.sh starts slurmctld, slurmd and munged")
    was_up = subprocess.run([str(SLURM_SCRIPT), "status"], capture_output=True, timeout=60).returncode == 0
    started = subprocess.run([str(SLURM_SCRIPT), "start"], capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        pytest.skip(started.stderr.strip() or f"{SLURM_SCRIPT} start exited {started.returncode}")
    yield
    if not was_up:
        subprocess.run([str(SLURM_SCRIPT), "stop"], check=True, timeout=60)


@pytest.mark.slow
def test_connect_to_ipcluster_slurm_engines(tmp_path, slurm):
    assert slurm_jobs() == [], "another Slurm job is queued; this test wants the node to itself"
    with ipcluster(tmp_path, "slurm", 4) as profile_dir:
        pool = connect_when_ready(profile_dir, 4, timeout=240)
        try:
            assert len(slurm_jobs()) == 1  # the engines are one batch job
            check_ranks_reduce_and_train(pool)
        finally:
            pool.stop()
    deadline = time.monotonic() + 60
    while slurm_jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm_jobs() == []
