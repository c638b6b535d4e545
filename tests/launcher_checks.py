"""What every launcher's pool must do: its engines are ranks that all_reduce, and a DP2xTP2
training on them matches the one-process reference. Shared by the MPI, ipcluster and Slurm tests."""
from __future__ import annotations

import psutil
import pytest

import lab
from lab.pool import launchers

TINY = lab.GPT(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)


def needs_mpi() -> None:
    """Skip, saying what is missing, where mpiexec or mpi4py is not installed (``.ci/run`` installs both)."""
    try:
        launchers.check_launcher("mpi")
    except ValueError as missing:
        pytest.skip(str(missing))


def rank_sum() -> float:
    """Each rank contributes its rank number; every rank gets the sum."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def check_ranks_reduce_and_train(pool: lab.Cluster) -> None:
    """The pool's 4 engines are ranks 0..3 of one world, and DP2xTP2 trains like the reference."""
    assert pool.world_size == 4
    assert pool.run(rank_sum) == [6.0] * 4
    exp = lab.Experiment(pool, TINY, lab.Parallel(dp=2, tp=2), global_batch=4, steps=2)
    result, reference = exp.run(), exp.reference()
    assert result.matches(reference, rtol=1e-4), result.loss_table(reference)


def alive(pids: set[int]) -> list[int]:
    """The PIDs among ``pids`` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
