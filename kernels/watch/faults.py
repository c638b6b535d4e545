"""Faults on purpose, and compute paced to a known cost: what ``lab.Slow/Hang/Crash/Kill`` do on a rank.

Each fault is a ``kernels.contract.faults.Fault`` the driver checked before launch (``lab.run.faults``):

- ``Fault(SLOW, rank=r, factor=f)``: rank r's compute takes f times as long.
  With real compute each forward sleeps (f - 1) x its own measured time afterwards, and
  each backward sleeps (f - 1) x 2 x that forward time before it starts (the usual
  "backward costs two forwards"). With synthetic time (``synthetic_forward_s = t`` on a
  layout without pipeline) every rank's forward is padded to t and every backward
  sleeps 2t first, so compute has a known cost; the slow rank's are f x those;
- ``Fault(HANG, rank=r, at_step=s)``: rank r stops in the first forward of
  step s and never comes back (it sleeps in short slices, so SIGINT still ends it);
- ``Fault(CRASH, rank=r, at_step=s)``: rank r raises ``InjectedCrash`` there;
- ``Fault(KILL, rank=r, at_step=s)``: rank r SIGKILLs its own engine there.

The timing points are module hooks (forward pre/post hook, a gradient hook on the
output for the start of backward), so every layout gets them without changing its
step function. Straggler teaching: a slow rank enters the gradient all-reduce late, so
the others wait there for it (Li et al., 2020, PyTorch DDP, sec. 5 on stragglers).

Run alone (pads one forward and one backward of a linear layer, slow x 2)::

    python -m kernels.watch.faults
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kernels.contract.faults import Fault, FaultKind

HANG_SLICE_S = 0.05  # a hung rank sleeps in slices this long, so an interrupt ends it at once


class InjectedCrash(RuntimeError):
    """Raised on purpose by ``lab.Crash``."""


@dataclass
class Pacing:
    """How long this rank's forward and backward should take: real x factor, or synthetic x factor."""

    factor: float = 1.0  # > 1 on a rank made slow
    synthetic_forward_s: float | None = None  # t: every forward padded to t x factor, backward 2t x factor first

    @property
    def active(self) -> bool:
        return self.factor > 1.0 or self.synthetic_forward_s is not None

    def after_forward(self, began: float) -> float:
        """Sleep so the forward that began at ``began`` lasts its target; returns its real compute seconds."""
        real = time.perf_counter() - began
        target = self.factor * (self.synthetic_forward_s if self.synthetic_forward_s is not None else real)
        _sleep(began + target - time.perf_counter())
        return real

    def before_backward(self, forward_real_s: float) -> None:
        """Sleep what the backward adds to its real compute: 2t x factor, or (factor - 1) x 2 x the real forward."""
        if self.synthetic_forward_s is not None:
            _sleep(2.0 * self.synthetic_forward_s * self.factor)
        else:
            _sleep((self.factor - 1.0) * 2.0 * forward_real_s)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def faults_for(faults: Iterable[Fault | Mapping[str, Any]], rank: int) -> list[Fault]:
    """The faults that act on ``rank`` (records, or their dicts)."""
    return [f for f in map(Fault.coerce, faults) if f.rank == rank]


def pacing_for(faults: list[Fault], synthetic_forward_s: float | None) -> Pacing:
    """This rank's pacing: the product of its Slow factors, on real or synthetic time."""
    factor = 1.0
    for f in faults:
        if f.kind is FaultKind.SLOW:
            factor *= float(f.factor)
    return Pacing(factor, synthetic_forward_s)


def note_slow(faults: list[Fault], note: Any) -> None:
    """``note(text)`` for each slow fault: it acts from the first step, so it is noted at the start."""
    for fault in faults:
        if fault.kind is FaultKind.SLOW:
            note(f"{fault.describe()} from the start")


def strike(fault: Fault, step: int, note: Any) -> None:
    """Apply a step fault (hang, crash, kill) due at ``step``; ``note(text)`` records it first.

    Called from the first forward of each step on the rank, so the rank's last traced
    action is that forward.
    """
    if fault.kind is FaultKind.SLOW or fault.at_step != step:
        return
    note(f"{fault.describe()} struck at step {step}")
    if fault.kind is FaultKind.CRASH:
        raise InjectedCrash(f"lab.Crash: rank {fault.rank} raised on purpose in the forward of step {step}")
    if fault.kind is FaultKind.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: never return, but stay interruptible (time.sleep ends on SIGINT)
        time.sleep(HANG_SLICE_S)


def output_tensor(out: Any) -> torch.Tensor | None:
    """The tensor whose gradient marks the start of this module's backward: the output, or its first grad-requiring part."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, (tuple, list)):
        for item in out:
            found = output_tensor(item)
            if found is not None:
                return found
    return None


def _demo() -> None:
    layer = torch.nn.Linear(64, 64)
    pacing = Pacing(factor=2.0, synthetic_forward_s=0.01)
    layer(torch.randn(8, 64))  # warm-up: the first call pays one-off setup
    began = time.perf_counter()
    out = layer(torch.randn(8, 64))
    real = pacing.after_forward(began)
    print(f"forward: real {real * 1e3:.2f} ms, paced {(time.perf_counter() - began) * 1e3:.1f} ms (target 20 ms)")
    began = time.perf_counter()
    pacing.before_backward(real)
    out.sum().backward()
    print(f"backward: {(time.perf_counter() - began) * 1e3:.1f} ms (target 40 ms + real)")


if __name__ == "__main__":
    _demo()
