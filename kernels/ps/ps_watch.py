"""What a parameter-server rank is doing, readable while it is blocked: the lab's collective log, for RPC.

A PS run has no collectives to hook: a worker waits in an RPC push, which a server
answers only when it applies the gradients (sync: once every worker has pushed;
bounded: once no reader would fall too far behind). So each rank publishes its state
through the same ``kernels.watch.collective_log.CollectiveLog`` as a training rank, and the
driver's ``lab.pool.hang_report.HangWatch`` reads it unchanged:

- a worker: "step t begins" (a fault strikes here), then the actions "pull, step t" and
  "compute, step t", and its push of step t as the wait ``push #t+1 of group
  workers=[...]``: the group is every worker, because in sync mode that push returns
  once all of them have pushed, so a worker that never pushes is the one that "never
  entered it";
- a server: "serving <n> parameters; workers [...] still training" (updated as workers
  finish) until they are all done, then "done". Its state changes only on its main
  thread: the applies run on RPC threads, and the log has one writer;
- every rank: the closing barrier, which a rank that is through waits in for the others,
  then "done".

On an engine a ``kernels.watch.flight_recorder.WatchBeacon`` also sends the state over
ipyparallel, for a driver on another host.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from kernels.contract.faults import Fault
from kernels.watch import faults as fault_kinds
from kernels.watch import flight_recorder
from kernels.watch.collective_log import CollectiveLog
from kernels.watch.state_file import PUBLISH_EVERY_S

PUSH_GROUP = "workers"


@contextlib.contextmanager
def ps_watch(rank: int, faults: list[Fault]) -> Iterator[CollectiveLog]:
    """This rank's collective log (and its beacon on an engine) for one PS run; ``faults`` are this rank's."""
    log = CollectiveLog(rank, publish_every_s=PUBLISH_EVERY_S)
    fault_kinds.note_slow(faults, log.note_fault)
    beacon = flight_recorder.engine_beacon(log.path, {})
    if beacon is not None:
        beacon.start()
    try:
        yield log
    finally:
        if beacon is not None:
            beacon.stop()
        log.close()


def logged_barrier(log: CollectiveLog) -> None:
    """``dist.barrier()`` as a wait the log shows ("barrier #n of group world=[...]")."""
    token = log.enter("barrier", "world", tuple(range(dist.get_world_size())), 0)
    try:
        dist.barrier()
    finally:
        log.leave(token)
