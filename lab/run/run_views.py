"""What follows a ``RunHandle`` on screen: a tqdm progress bar for ``run()``, a live ``TrainingDashboard``.

Both are fed from the handle's monitor thread with the records as they arrive; the
widgets never see the handle, only plain records (``widgets`` imports no lab code).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from kernels.contract.model_rules import is_own_model
from kernels.contract.watch_records import StepProgress
from lab.measure.throughput import flops_per_token
from lab.measure.throughput import peak_flops as device_peak

if TYPE_CHECKING:
    from lab.run.run_handle import RunHandle
    from widgets import TrainingDashboard


@contextlib.contextmanager
def progress_bar(handle: "RunHandle", show: bool = True, desc: str | None = None) -> Iterator[None]:
    """A tqdm bar (the notebook widget in Jupyter) that counts the steps every rank has finished."""
    if not show:
        yield
        return
    from tqdm.auto import tqdm

    steps = handle.config["steps"]
    bar = tqdm(total=steps, desc=desc or f"training on {handle.world_size} ranks", unit="step")
    done_by_rank: dict[int, int] = {}

    def advance(records: list[StepProgress]) -> None:
        for record in records:
            done_by_rank[record.rank] = max(done_by_rank.get(record.rank, -1), record.step)
        if len(done_by_rank) == handle.world_size:
            everywhere = min(done_by_rank.values()) + 1
            if everywhere > bar.n:
                bar.update(everywhere - bar.n)
                last = records[-1]
                bar.set_postfix(loss=f"{last.loss:.4f}", step_ms=f"{1e3 * last.step_s:.1f}", refresh=False)

    handle.follow(advance)
    try:
        yield
    finally:
        handle.unfollow(advance)  # a wait that was interrupted leaves the run going: the closed bar stops following
        bar.close()


def follow_dashboard(handle: "RunHandle", stale_after: float,
                     peak_flops: float | str | None = None) -> "TrainingDashboard":
    """A dashboard that shows every record so far, then each new one as it arrives, and the end of the run.

    With ``peak_flops`` (one device's FLOP/s or a GPU's name) it shows MFU beside tokens/s, for the lab's own
    models: a model the user brought is counted from its parameters, known once the run's layout is
    (``RunResult.dashboard(peak_flops=...)``)."""
    from widgets import TrainingDashboard

    model, per_token = handle.config["model"], None
    if peak_flops is not None and not is_own_model(model):
        recompute = handle.config.get("strategy", {}).get("activation_checkpointing", False)
        per_token = flops_per_token(model, recompute)[0]
    view = TrainingDashboard(world_size=handle.world_size, steps=handle.config["steps"], stale_after=stale_after,
                             flops_per_token=per_token, peak_flops=device_peak(peak_flops) if per_token else None)

    def show(records: list[StepProgress]) -> None:
        view.add(records, heard_at=handle.heard_at())

    handle.follow(show)
    handle.on_finish(lambda: view.finish(heard_at=handle.heard_at()))
    if handle.done:
        view.finish(heard_at=handle.heard_at())
    return view
