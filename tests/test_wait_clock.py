"""The wait clock sees a rank wait for a late peer: in a plain all_reduce, and in DDP's end-of-backward bucket wait."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.watch.wait_clock import WaitClock
from tests.spawned_ranks import pooled_runner

LATE_S = 1.0  # rank 1 arrives this late; rank 0 must have waited for it


def waiting_rank(case: dict) -> float:
    """This rank's seconds waiting in collectives while rank 1 arrives ``LATE_S`` late (spawned rank body)."""
    clock = WaitClock()
    clock.install()
    try:
        model = DDP(torch.nn.Linear(4, 4)) if case["ddp"] else None
        if model is not None:
            assert clock.watch_ddp(model)
            loss = model(torch.ones(2, 4)).sum()
        dist.barrier()
        clock.take()  # what the set-up waited is not the case's
        if dist.get_rank() == 1:
            time.sleep(LATE_S)
        if model is not None:
            loss.backward()  # rank 0's reducer waits for rank 1's bucket at the end of backward
        else:
            dist.all_reduce(torch.ones(1))
        return clock.take()
    finally:
        clock.remove()


@pytest.fixture(scope="module")
def two_ranks():
    yield from pooled_runner(waiting_rank, lambda case: 2)


@pytest.mark.parametrize("ddp", [False, True], ids=["all_reduce", "ddp"])
def test_the_early_rank_waits_for_the_late_one(two_ranks, ddp):
    waited = two_ranks({"ddp": ddp})
    assert waited[0] >= 0.5 * LATE_S, waited  # it cannot finish before rank 1 arrives
    assert waited[0] > waited[1] + 0.3 * LATE_S, waited
    assert dist.Work.wait.__name__ == "wait"  # removed: this process never had it patched
