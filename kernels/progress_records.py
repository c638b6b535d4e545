"""``StepProgress``: what one rank says about each step it finished, while the run goes on (torch-free).

Ranks send these (as dicts) to the driver through ipyparallel's data channel
(``kernels.progress``); the driver's ``lab.run_handle.RunHandle`` gathers them, and the
views (``widgets.TrainingDashboard``) and loggers (``lab.run_logs``) read them. A list of
these dicts, saved with the run, replays in the same views.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.records import Record


@dataclass(frozen=True)
class StepProgress(Record):
    """One finished step on one rank.

    ``collective_s`` is the time the rank's main thread spent blocked waiting for
    collectives in the step (``kernels.wait_clock``), ``compute_s`` the rest of ``step_s``.
    ``tokens_per_s`` is the global batch's tokens over this rank's step time.
    ``memory_kind`` says what ``memory_bytes`` is: "rss" (the process's resident memory)
    or "cuda" (tensor memory allocated on the rank's GPU).
    ``sent_at`` is the rank's wall clock (Unix seconds) when the record left.
    """

    rank: int
    step: int
    steps: int
    loss: float
    step_s: float
    tokens_per_s: float
    collective_s: float
    compute_s: float
    memory_bytes: int
    memory_kind: str
    sent_at: float
