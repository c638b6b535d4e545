"""Compare pipeline schedules at a glance: several traced runs side by side on one time axis."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab.run.run_result import NotRecordedError, RunResult


def _named(results: Any) -> list[tuple[str, RunResult]]:
    if isinstance(results, Mapping):
        return [(str(name), r) for name, r in results.items()]
    named = []
    for r in results:  # unnamed: the schedule and micro-batches say which is which
        b = r.bubble or {}
        named.append((f"{b.get('schedule', 'run')} m={b.get('microbatches', '?')}", r))
    return named


def _panels(results: Any) -> dict[str, dict[str, Any]]:
    panels: dict[str, dict[str, Any]] = {}
    for name, r in _named(results):
        if not isinstance(r, RunResult):
            raise TypeError(f"{name!r}: expected a RunResult (what Experiment.run() returns), got {type(r).__name__}")
        if not r.events:
            raise NotRecordedError(f"{name!r} recorded no trace events: pass trace=True (a pipeline layout, pp > 1) "
                                   "to lab.Experiment and run it again")
        if name in panels:
            raise ValueError(f"two runs are both named {name!r}: pass {{name: result}} with distinct names")
        panels[name] = {"events": r.events, "bubble": r.bubble or None}
    if not panels:
        raise ValueError("compare_schedules needs at least one traced run")
    return panels


def compare_schedules(results: Any, *, present: bool = False):
    """``widgets.ScheduleGallery`` of ``results`` (``{name: RunResult}`` in display order, or a list of
    RunResults named by schedule): one panel per run, compute boxes on one shared time axis from each
    run's first compute start, the measured bubble beside the theory, and one replay for all panels.
    ``present``: larger fonts and a colour-blind-safe high-contrast palette, for projecting."""
    from widgets import ScheduleGallery
    return ScheduleGallery(_panels(results), present=present)


def plot_schedules(results: Any):
    """The same comparison as a matplotlib Figure (``widgets.plot_gallery``), for slides."""
    from widgets import plot_gallery
    return plot_gallery(_panels(results))
