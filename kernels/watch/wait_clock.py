"""How long a rank's main thread waits for collectives: ``WaitClock``, read once per step.

Algorithm: a rank blocks for a collective in one of two Python calls, so while a
listener is installed both are timed, whoever calls them:

- ``torch.distributed.Work.wait``: a blocking ``dist.all_reduce`` waits on its own work
  object; FSDP2's async all-gathers and pipelining's p2p are waited on through it;
- ``torch.distributed._functional_collectives.wait_tensor``: DTensor's functional
  collectives (tensor and sequence parallelism, loss parallel) return an
  ``AsyncCollectiveTensor`` that waits, on first use, through this module function
  (which runs the C++ ``_c10d_functional.wait_tensor`` op), so patching the module
  attribute catches every eager wait DTensor makes.

DDP's C++ reducer waits for its bucket all-reduces without Python: ``watch_ddp``
registers torch's stock all-reduce comm hook (the same maths as DDP's own) wrapped to
note when the last bucket was launched, and an autograd callback, queued after DDP's own
finalizer, adds the time from then until the backward's end (the finalizer's wait for
every bucket).

Listeners (``install_listener``): ``WaitClock`` sums the seconds; the collective log
(``kernels.watch.collective_log``) opens a span for each wait, so a wait outside its own
wrapped calls (p2p, functional collectives) counts in a step's wait time too.

On a GPU the time is the host's wait, which is not the device's: the loop does not
sync the host per step, so there a wait seldom blocks and the figure reads low.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

_original_wait = dist.Work.wait
_original_wait_tensor = funcol.wait_tensor
_lock = threading.Lock()


class WaitListener(Protocol):
    """Told when a timed wait begins and how long it lasted (on the waiting thread)."""

    def wait_began(self) -> None: ...

    def wait_ended(self, seconds: float) -> None: ...


_listeners: tuple[WaitListener, ...] = ()  # replaced whole, so a waiting thread iterates a stable tuple


def _timed(original: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a compiled region traces the op itself, not our clock
            return original(*args, **kwargs)
        listeners = _listeners
        for listener in listeners:
            listener.wait_began()
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent = time.perf_counter() - began
            for listener in listeners:
                listener.wait_ended(spent)
    return timed


_timed_wait, _timed_wait_tensor = _timed(_original_wait), _timed(_original_wait_tensor)


def install_listener(listener: WaitListener) -> None:
    """Time every collective wait for ``listener`` until ``remove_listener``; patches on the first."""
    global _listeners
    with _lock:
        _listeners = (*_listeners, listener)
        dist.Work.wait = _timed_wait
        funcol.wait_tensor = _timed_wait_tensor


def remove_listener(listener: WaitListener) -> None:
    """Stop telling ``listener``; the originals come back with the last one gone."""
    global _listeners
    with _lock:
        _listeners = tuple(x for x in _listeners if x is not listener)
        if not _listeners:
            dist.Work.wait = _original_wait
            funcol.wait_tensor = _original_wait_tensor


def wait_untimed(work: Any) -> Any:
    """Wait for ``work`` without counting it (the progress machinery's own collectives)."""
    return _original_wait(work)


class WaitClock:
    """Seconds spent waiting for collectives since the last ``take()``; ``install`` / ``remove`` bracket a run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._last_launch: float | None = None

    def install(self) -> None:
        install_listener(self)

    def remove(self) -> None:
        remove_listener(self)

    def wait_began(self) -> None:
        """Nothing to do: the clock adds a wait once it ends."""

    def wait_ended(self, seconds: float) -> None:
        self.seconds += seconds

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
