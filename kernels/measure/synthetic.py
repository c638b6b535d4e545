"""Synthetic stage cost: every pipeline action lasts a fixed time, so bubbles match theory.

The bubble formulas of GPipe (Huang et al., 2019) and 1F1B (Narayanan et al., 2019,
PipeDream; Megatron-LM) assume every stage takes the same time t for a forward and
2t for a backward. A tiny CPU model is nothing like that: Python and p2p overhead
per action dominate (docs/design.md#real-compute-bubbles). In synthetic-cost mode
the real (tiny) compute still runs, so activations, gradients and the pipeline's
p2p traffic stay valid, and then the action *sleeps until its target end*::

    start = now(); real_compute(); sleep(start + target - now())

so its measured duration is the target (plus the sleep's wake-up latency) whenever
the compute is shorter than the target, which ``overruns`` counts. We pad rather
than replace the compute because the schedule needs real tensors to send, and
sleeping (not spinning) leaves the shared cores to the other ranks.

Targets, with ``t`` the forward time of one micro-batch through *one rank's whole
share* of the model and v stages per rank (each stage holds 1/v of that share):

- forward F: t/v;  full backward B: 2t/v;
- zero-bubble split: input-grad I: t/v and weight-grad W: t/v (I + W = B);
- on a rank made slow (``lab.Slow(rank, f)``) every target times f (``scale``), so the
  slow-down shows in the padded actions instead of vanishing inside the pad.

Run alone (prints the targets and checks one padded action)::

    python -m kernels.measure.synthetic
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

# Cost of each action letter (torch's _ComputationType names) in units of t/v.
ACTION_UNITS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class OversubscribedComputeWarning(UserWarning):
    """Real compute runs on more ranks than cores, so measured times include waiting for a core."""


@dataclass
class SyntheticCost:
    """Fixed per-action durations; ``pad`` sleeps an action up to its target."""

    forward_s: float  # t: one micro-batch's forward through one rank's share of the model
    stages_per_rank: int = 1  # v: each stage's targets are divided by v
    scale: float = 1.0  # this rank's Slow factor: every target times it
    overruns: int = field(default=0, init=False)  # actions whose real compute exceeded the target
    worst_overrun_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.forward_s <= 0 or self.stages_per_rank < 1 or self.scale < 1:
            raise ValueError(f"SyntheticCost needs forward_s > 0, stages_per_rank >= 1 and scale >= 1, "
                             f"got {self.forward_s}, {self.stages_per_rank}, {self.scale}")

    def target(self, action: str) -> float:
        """Seconds one action (F, B, I or W) should last on one stage."""
        return ACTION_UNITS[action] * self.forward_s * self.scale / self.stages_per_rank

    def pad(self, start: float, action: str) -> None:
        """Sleep until ``start + target(action)`` on the ``time.perf_counter`` clock."""
        remaining = start + self.target(action) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        else:
            self.overruns += 1
            self.worst_overrun_s = max(self.worst_overrun_s, -remaining)

    def summary(self) -> dict:
        """Plain record of the settings and how often real compute did not fit."""
        return {"forward_s": self.forward_s, "stages_per_rank": self.stages_per_rank, "scale": self.scale,
                "targets_s": {a: self.target(a) for a in ACTION_UNITS},
                "overruns": self.overruns, "worst_overrun_s": self.worst_overrun_s}


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def oversubscription_warning(ranks_on_host: int, synthetic: bool) -> str | None:
    """A warning (also raised as a Python warning) when real compute has more ranks than cores.

    Synthetic mode sleeps, so ranks do not compete for cores and no warning is given.
    """
    cores = usable_cores()
    if synthetic or ranks_on_host <= cores:
        return None
    msg = (f"real compute with {ranks_on_host} ranks on {cores} cores: ranks wait for a core, "
           f"so measured action times and bubbles include that wait (use synthetic cost mode "
           f"to compare with theory)")
    warnings.warn(msg, OversubscribedComputeWarning, stacklevel=2)
    return msg


def _demo() -> None:
    cost = SyntheticCost(forward_s=0.02, stages_per_rank=2)
    print("targets (s):", cost.summary()["targets_s"])
    start = time.perf_counter()
    sum(range(10_000))  # stands in for the real compute
    cost.pad(start, "B")
    print(f"padded B lasted {time.perf_counter() - start:.4f} s (target {cost.target('B'):.4f} s)")


if __name__ == "__main__":
    _demo()
