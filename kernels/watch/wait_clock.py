"""How long a rank's main thread waits for collectives: ``WaitClock``, read once per step.

Algorithm: every wait for a collective that Python makes goes through
``torch.distributed.Work.wait`` (a blocking ``dist.all_reduce`` waits on its own work
object; FSDP2 and pipelining wait on the works of their async collectives and p2p), so
while the clock is installed that one method is timed, whoever calls it. DDP's C++
reducer waits for its bucket all-reduces without Python: ``watch_ddp`` registers torch's
stock all-reduce comm hook (the same maths as DDP's own) wrapped to note when the last
bucket was launched, and an autograd callback, queued after DDP's own finalizer, adds the
time from then until the backward's end (the finalizer's wait for every bucket).
Not seen: DTensor's functional collectives (tensor parallelism), which wait in C++.

On a GPU the time is the host's wait, which is not the device's: the loop does not
sync the host per step, so there a wait seldom blocks and the figure reads low.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

_original_wait = dist.Work.wait
_installed: list["WaitClock"] = []  # the clocks timing Work.wait now (one per run)
_lock = threading.Lock()


def _timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
    began = time.perf_counter()
    try:
        return _original_wait(work, *args, **kwargs)
    finally:
        spent = time.perf_counter() - began
        for clock in _installed:
            clock.seconds += spent


def wait_untimed(work: Any) -> Any:
    """Wait for ``work`` without counting it (the progress machinery's own collectives)."""
    return _original_wait(work)


class WaitClock:
    """Seconds spent waiting for collectives since the last ``take()``; ``install`` / ``remove`` bracket a run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._last_launch: float | None = None

    def install(self) -> None:
        with _lock:
            _installed.append(self)
            dist.Work.wait = _timed_wait

    def remove(self) -> None:
        with _lock:
            if self in _installed:
                _installed.remove(self)
            if not _installed:
                dist.Work.wait = _original_wait

    def take(self) -> float:
        """The seconds waited since the last call, and start counting afresh."""
        spent, self.seconds = self.seconds, 0.0
        return spent

    def watch_ddp(self, model: torch.nn.Module) -> bool:
        """Time DDP's end-of-backward wait for its buckets; False when the module is not DDP (or has a hook)."""
        if not isinstance(model, DDP) or getattr(model, "_comm_hooks", None):
            return False
        model.register_comm_hook(model.process_group, self._ddp_hook)
        return True

    def _ddp_hook(self, group, bucket):  # unannotated: DDP compares annotations with classes, and these are strings
        future = default_hooks.allreduce_hook(group, bucket)
        if bucket.is_last():
            self._last_launch = time.perf_counter()
            # The reducer queues its finalizer (which waits for every bucket) just after this hook returns;
            # a callback queued from a callback runs after those already queued, so after the finalizer.
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(self._backward_done))
        return future

    def _backward_done(self) -> None:
        if self._last_launch is not None:
            self.seconds += time.perf_counter() - self._last_launch
            self._last_launch = None
