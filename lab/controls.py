"""Live controls: change dp/tp/pp/ZeRO/schedule/micro-batches on a warm pool and re-run in place.

Every change is checked with the same rules as ``lab.Parallel`` (``Parallel.check``);
a broken rule is explained inline, by name, and the Run button stays disabled until
the layout is valid. Run trains on the ranks already up (no relaunch), with the
experiment's ``trace``/``measure`` options, then updates the loss table and every view
below it in place: sharding always, the pipeline timeline when the layout has a pipeline
and the experiment traces, memory when it measures. Once the pool stops, Run goes away
and a note says why.
"""
from __future__ import annotations

import html
import time
from typing import Any

import ipywidgets as w

from lab.experiment import Experiment
from kernels.layout_rules import SCHEDULES
from lab.parallel import Parallel, ParallelConfigError
from lab.run_result import RunResult
from widgets import MemoryView, PipelineTimeline, ShardingView


class Controls:
    """Dropdowns and sliders for ``exp``'s layout, a Run button and the views it refreshes."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.result: RunResult | None = None
        self._reference: RunResult | None = None
        world, p = exp.cluster.world_size, exp.parallel
        sizes = [d for d in range(1, world + 1) if world % d == 0]
        self.fields: dict[str, w.ValueWidget] = {
            "dp": w.Dropdown(options=sizes, value=p.dp, description="dp"),
            "tp": w.Dropdown(options=sizes, value=p.tp, description="tp"),
            "pp": w.Dropdown(options=sizes, value=p.pp, description="pp"),
            "zero": w.Dropdown(options=[0, 1, 2, 3], value=p.zero, description="ZeRO"),
            "schedule": w.Dropdown(options=list(SCHEDULES), value=p.schedule, description="schedule"),
            "microbatches": w.IntSlider(value=p.num_microbatches, min=1, max=32, description="micro-batches"),
            "stages_per_rank": w.IntSlider(value=p.num_stages_per_rank, min=1, max=4, description="stages/rank"),
            "sequence_parallel": w.Checkbox(value=p.sequence_parallel, description="sequence parallel"),
            "activation_checkpointing": w.Checkbox(value=p.activation_checkpointing, description="act. ckpt"),
        }
        self.explanation = w.HTML()
        self.button = w.Button(description="Run", button_style="primary")
        self.status = w.HTML()
        self.losses = w.HTML()
        self.sharding = ShardingView()
        self.timeline = PipelineTimeline()
        self.memory = MemoryView()
        self.timeline.layout.display = self.memory.layout.display = "none"  # until a run records them
        for field in self.fields.values():
            field.observe(lambda _: self.validate(), names="value")
        self.button.on_click(lambda _: self.run())
        self.widget = w.VBox([w.HBox(list(self.fields.values())[:5]), w.HBox(list(self.fields.values())[5:]),
                              self.explanation, w.HBox([self.button, self.status]), self.losses, self.sharding,
                              self.timeline, self.memory])
        self.widget.add_class("cl-controls")
        self.validate()
        exp.cluster.on_stop(self._pool_stopped)

    def _pool_stopped(self) -> None:
        self.button.disabled = True
        self.button.layout.display = "none"
        self.status.value = ("<span class='cl-stopped'>the pool is stopped: start one and build new controls "
                             "to run again (the views below show the last run)</span>")

    def parallel(self) -> Parallel:
        """The layout the controls show now (raises ParallelConfigError if it breaks a rule)."""
        return Parallel(**{name: field.value for name, field in self.fields.items()})

    def validate(self) -> list[str]:
        """Check the shown layout; explain broken rules inline and enable Run only when valid."""
        try:
            warnings = self.parallel().check(self.exp.model, self.exp.cluster.world_size, self.exp.global_batch)
        except ParallelConfigError as error:
            if self.exp.cluster.stopped:
                return []
            self.explanation.value = "<div class='cl-invalid'>" + "<br>".join(
                f"<b>[{html.escape(rule)}]</b> {html.escape(msg)}" for rule, msg in error.problems) + "</div>"
            self.button.disabled = True
            return [f"[{rule}] {msg}" for rule, msg in error.problems]
        self.explanation.value = "".join(f"<div class='cl-warning'>warning: {html.escape(m)}</div>" for m in warnings)
        self.button.disabled = self.exp.cluster.stopped
        return []

    def run(self) -> RunResult:
        """Train the shown layout on the warm pool and refresh the loss table and views."""
        exp = self.exp
        parallel = self.parallel()
        trace = exp.trace and parallel.pp > 1  # tracing times pipeline actions: a layout without one has none
        new = Experiment(exp.cluster, exp.model, parallel, global_batch=exp.global_batch, steps=exp.steps,
                         lr=exp.lr, seed=exp.seed, trace=trace,
                         synthetic_forward_s=exp.synthetic_forward_s if trace else None, measure=exp.measure,
                         compile=exp.compile)
        self.button.disabled = True
        self.status.value = f"running {html.escape(new.parallel.describe())} on {exp.cluster.world_size} ranks…"
        began = time.perf_counter()
        try:
            self.result = new.run()
        except Exception as error:
            self.status.value = f"<span class='cl-failed'>failed: {html.escape(str(error).splitlines()[0])}</span>"
            raise
        finally:
            self.button.disabled = exp.cluster.stopped
        if self._reference is None:
            self._reference = exp.reference()
        self.status.value = f"done in {time.perf_counter() - began:.1f} s"
        self.losses.value = _loss_table_html(self.result, self._reference)
        self.sharding.set_layout(self.result.layout)
        self._refresh_measured(self.result)
        return self.result

    def _refresh_measured(self, result: RunResult) -> None:
        """The timeline and memory views follow the run; one the run did not record is hidden, not stale."""
        if result.events:
            self.timeline.update(result.events, result.bubble or None,
                                 {rank: acts for rank, acts in enumerate(result.planned) if acts})
        if result.memory_records:
            self.memory.update(result.memory_records)
        self.timeline.layout.display = None if result.events else "none"
        self.memory.layout.display = None if result.memory_records else "none"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def _loss_table_html(result: RunResult, reference: RunResult) -> str:
    rows = "".join(f"<tr><td>{i}</td><td>{a:.6f}</td><td>{b:.6f}</td><td>{abs(a - b) / abs(b):.1e}</td></tr>"
                   for i, (a, b) in enumerate(zip(result.losses, reference.losses)))
    verdict = "equal to one process" if result.matches(reference) else "DIFFERENT from one process"
    return (f"<table class='cl-losses'><tr><th>step</th><th>loss</th><th>one process</th><th>rel. diff</th></tr>"
            f"{rows}</table><p>{html.escape(verdict)}</p>")
