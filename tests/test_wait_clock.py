"""The wait clock sees a rank wait for a late peer: in a plain all_reduce, in DDP's end-of-backward bucket wait, and in
a DTensor redistribution (a functional collective, as tensor parallelism runs them)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.watch.wait_clock import WaitClock
from tests.spawned_ranks import pooled_runner

LATE_S = 1.0  # rank 1 arrives this late; rank 0 must have waited for it


def waiting_rank(case: dict) -> float:
    """This rank's seconds waiting in collectives while rank 1 arrives ``LATE_S`` late (spawned rank body)."""
    clock = WaitClock()
    clock.install()
    try:
        model = DDP(torch.nn.Linear(4, 4)) if case["kind"] == "ddp" else None
        if model is not None:
            assert clock.watch_ddp(model)
            loss = model(torch.ones(2, 4)).sum()
        mesh = init_device_mesh("cpu", (2,)) if case["kind"] == "dtensor" else None
        dist.barrier()
        clock.take()  # what the set-up waited is not the case's
        if dist.get_rank() == 1:
            time.sleep(LATE_S)
        if model is not None:
            loss.backward()  # rank 0's reducer waits for rank 1's bucket at the end of backward
        elif mesh is not None:  # partial sums made whole: an all_reduce that waits in C++ on first use of the result
            summed = DTensor.from_local(torch.ones(2), mesh, [Partial()]).redistribute(mesh, [Replicate()])
            assert summed.to_local().add(0).tolist() == [2.0, 2.0]
        else:
            dist.all_reduce(torch.ones(1))
        return clock.take()
    finally:
        clock.remove()


@pytest.fixture(scope="module")
def two_ranks():
    yield from pooled_runner(waiting_rank, lambda case: 2)


@pytest.mark.parametrize("kind", ["all_reduce", "ddp", "dtensor"])
def test_the_early_rank_waits_for_the_late_one(two_ranks, kind):
    waited = two_ranks({"kind": kind})
    assert waited[0] >= 0.5 * LATE_S, waited  # it cannot finish before rank 1 arrives
    assert waited[0] > waited[1] + 0.3 * LATE_S, waited
    assert dist.Work.wait.__name__ == "wait"  # removed: this process never had it patched
