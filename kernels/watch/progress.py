"""Live progress from the training loop: one ``StepProgress`` per finished step, and a clean stop on request.

The loop calls ``ProgressReporter.step_done`` once per step (its only hook); the
reporter times the step's waits for collectives (``kernels.watch.wait_clock``), reads the
rank's memory and sends the record through ipyparallel's own engine-to-client channel
(``ipyparallel.datapub.publish_data``, which the client merges into the call's
metadata as it arrives; outside an engine, e.g. under torchrun, nothing is sent).
Each step is its own key (``progress.<step>``), so no record overwrites another; the records
of the steps that end within ``SEND_EVERY_S`` travel in one message.

Stopping: the driver sends ``STOP_SIGNAL`` to every rank (``lab.run.run_handle``). The
signal only sets a flag; at each step's end every rank all_reduces (MAX) its flag over
the world, asynchronously, and reads the previous step's result: every rank reads the
same value at the same step, so all stop together at one step boundary and no rank is
left waiting in a collective. The handler stays installed after the run, so a late
signal never kills an idle engine.

On a GPU nothing here syncs the host in the step: the loss, the stop flag and the step's
CUDA events are copied or recorded without waiting and read one step late, when the
previous step has finished anyway (the last step's record is sent after the loop).
"""
from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from kernels.contract.watch_records import StepProgress
from kernels.watch.wait_clock import WaitClock, wait_untimed

STOP_SIGNAL = signal.SIGUSR2  # SIGUSR1 is kernels.watch.stack_report's
# Records go out together at most this often (and after the last step): one message per step per rank
# cost the ranks, the controller and the client CPU that a 20-step/s run on shared cores notices.
SEND_EVERY_S = 0.25
ARMED_KEY = "progress.armed"  # published once the stop handler is installed: the driver may signal from then on
_stop_asked = False


def _ask_stop(signum: int, frame: Any) -> None:
    global _stop_asked
    _stop_asked = True


def arm_stop() -> None:
    """Install the stop handler (once per process) and clear any earlier request."""
    global _stop_asked
    _stop_asked = False
    if signal.getsignal(STOP_SIGNAL) is not _ask_stop:
        signal.signal(STOP_SIGNAL, _ask_stop)


def stop_asked() -> bool:
    """Whether ``STOP_SIGNAL`` arrived since the last ``arm_stop``."""
    return _stop_asked


def engine_publisher() -> Callable[[dict[str, Any]], None] | None:
    """ipyparallel's ``publish_data`` when this process is an engine running a call, else None."""
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell
    except ImportError:
        return None
    if not ZMQInteractiveShell.initialized() or getattr(ZMQInteractiveShell.instance(), "data_pub", None) is None:
        return None
    from ipyparallel.datapub import publish_data

    return publish_data


class _Late:
    """A device scalar read without waiting: at once on the CPU, one step late on a GPU (pinned copy + event)."""

    def __init__(self, value: torch.Tensor) -> None:
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = value, None

    def read(self) -> float:
        if self.event is not None:
            self.event.synchronize()  # recorded after the step it belongs to: the device has moved on
        return float(self.host.reshape(-1)[0])


class ProgressReporter:
    """Per-step records and the stop agreement for one run; use as a context manager around the loop."""

    def __init__(self, steps: int, tokens_per_step: int, device: torch.device, model: torch.nn.Module | None = None,
                 publish: Callable[[dict[str, Any]], None] | None = None,
                 waited: Callable[[], float] | None = None) -> None:
        self.rank, self.steps, self.tokens, self.device = dist.get_rank(), steps, tokens_per_step, device
        self.model, self.publish = model, publish
        # The collective log, when the run keeps one, already times every collective of the step
        # (its DDP comm hook leaves no room for the clock's); else the clock times Work.wait.
        self.waits = WaitClock() if waited is None else None
        self.waited = waited if waited is not None else self.waits.take
        self.flag = torch.zeros(1, device=device)
        self.flag_work: tuple[Any, _Late | None] | None = None  # (gloo work, or a GPU's late read)
        self.pending: dict[str, Any] | None = None  # a GPU's step, sent when the next one ends
        self.process = psutil.Process()
        self.stopped_at: int | None = None
        self.unsent: dict[str, Any] = {}  # records not yet sent, by key
        self.sent_at = time.monotonic()

    def __enter__(self) -> "ProgressReporter":
        arm_stop()
        if self.waits is not None:
            self.waits.install()
            if self.model is not None:
                self.waits.watch_ddp(self.model)
        self._send({ARMED_KEY: self.rank})
        return self

    def __exit__(self, *exc: object) -> None:
        if self.waits is not None:
            self.waits.remove()
        if self.pending is not None and exc[0] is None:
            self._report(self.pending)
        self.pending = None
        self._flush()  # a stopped run's last steps, or a failed one's

    def step_done(self, step: int, loss: torch.Tensor, clock: Any) -> bool:
        """After step ``step`` (its loss on the device, its marks in ``clock``): report it; True to stop now."""
        stop = self._stop_agreed()
        done = {"step": step, "loss": _Late(loss), "marks": clock.marks[step], "collective_s": self.waited(),
                "memory": self._memory()}
        if self.device.type == "cuda":  # send the previous step now (finished), keep this one
            if self.pending is not None:
                self._report(self.pending)
            self.pending = done
        else:
            self._report(done)
        if step < self.steps - 1 and not stop:  # a flag for the next boundary; none after the last step
            self.flag.fill_(1.0 if _stop_asked else 0.0)
            # c10d's own function, not the torch.distributed name the collective log and the
            # meter wrap: this flag is the lab's, in flight while the next step computes.
            work = distributed_c10d.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
            if self.device.type == "cuda":  # NCCL's wait only orders the stream; the copy is read next step
                wait_untimed(work)
                self.flag_work = (None, _Late(self.flag))
            else:  # gloo finishes it in its own thread while the next step computes
                self.flag_work = (work, None)
        if stop:
            self.stopped_at = step
        return stop

    def _stop_agreed(self) -> bool:
        """The previous step's world-wide MAX of the stop flags (the same answer on every rank)."""
        if self.flag_work is None:
            return False
        work, late = self.flag_work
        self.flag_work = None
        if work is not None:
            wait_untimed(work)
        return (late or _Late(self.flag)).read() > 0

    def _memory(self) -> tuple[int, str]:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device), "cuda"
        return self.process.memory_info().rss, "rss"

    def _report(self, done: dict[str, Any]) -> None:
        loss = done["loss"].read()  # first: on a GPU this waits for the step, so its events can be read
        begin, end = done["marks"]
        step_s = begin.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - begin
        collective = min(done["collective_s"], step_s)
        memory, kind = done["memory"]
        record = StepProgress(rank=self.rank, step=done["step"], steps=self.steps, loss=loss,
                              step_s=step_s, tokens_per_s=self.tokens / step_s if step_s > 0 else 0.0,
                              collective_s=collective, compute_s=step_s - collective, memory_bytes=memory,
                              memory_kind=kind, sent_at=time.time())
        self.unsent[f"progress.{record.step}"] = record.to_dict()
        if record.step == self.steps - 1 or time.monotonic() - self.sent_at >= SEND_EVERY_S:
            self._flush()

    def _flush(self) -> None:
        if self.unsent:
            self._send(self.unsent)
            self.unsent = {}
        self.sent_at = time.monotonic()

    def _send(self, data: dict[str, Any]) -> None:
        if self.publish is not None:
            self.publish(data)


def reporter_for(steps: int, tokens_per_step: int, device: torch.device, step_fn: Any,
                 world_size: int | None, waited: Callable[[], float] | None = None) -> contextlib.AbstractContextManager:
    """The run's reporter (as a context manager), watching the step function's DDP module if it has one.

    ``waited()``, when given, is this step's time in collectives so far (the collective log's).
    """
    if world_size not in (None, dist.get_world_size()):
        raise ValueError("progress agrees on stopping over every rank of the process group: train on all of them")
    return ProgressReporter(steps, tokens_per_step, device, getattr(step_fn, "model", None), engine_publisher(),
                            waited)
