"""Live controls: change dp/tp/pp/ZeRO/schedule/micro-batches on a warm pool and re-run in place.

Every change is checked with the same rules as ``lab.Parallel`` (``Parallel.check``);
a broken rule is explained inline, by name, and the Run button stays disabled until
the layout is valid. Run trains on the ranks already up (no relaunch), with the
experiment's ``trace``/``measure`` options, then updates the loss table and every view
below it in place: sharding always, the pipeline timeline when the layout has a pipeline
and the experiment traces, memory when it measures. Once the pool stops, Run goes away
and a note says why.

"keep weights" trains on instead of starting over: the first Run builds a ``lab.Training``
and trains ``exp.steps`` steps; each later Run moves its live weights and optimizer state
to the shown layout (``Training.relayout``) and trains ``exp.steps`` more, and the loss
table shows every step so far beside one process trained as long. Unticking it frees them.
"""
from __future__ import annotations

import dataclasses
import html
import math
import time
from typing import Any

import ipywidgets as w

from lab.run.experiment import Experiment
from kernels.contract.layout_rules import SCHEDULES
from lab.run.parallel import Parallel, ParallelConfigError
from lab.run.run_result import RunResult
from lab.run.training import Training
from widgets import MemoryView, PipelineTimeline, ShardingView
from widgets.static_figure import note_png, stack_pngs, with_static


class Controls:
    """Dropdowns and sliders for ``exp``'s layout, a Run button and the views it refreshes."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.result: RunResult | None = None
        self.training: Training | None = None  # the kept weights, while "keep weights" is ticked
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
        self.keep_weights = w.Checkbox(value=False, description="keep weights")
        self.keep_weights.observe(lambda change: change["new"] or self._drop_training(), names="value")
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
                              self.explanation, w.HBox([self.button, self.keep_weights, self.status]), self.losses, self.sharding,
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
        """The layout the controls show now (raises ParallelConfigError if it breaks a rule).

        The fields without a control (loss_parallel, mixed_precision, the FSDP strategy, the
        mesh order, ...) stay as the experiment's layout has them.
        """
        return dataclasses.replace(self.exp.parallel, **{name: field.value for name, field in self.fields.items()})

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
                         lr=exp.lr, optimizer=exp.optimizer, seed=exp.seed, trace=trace,
                         synthetic_forward_s=exp.synthetic_forward_s if trace else None, measure=exp.measure,
                         compile=exp.compile, data=exp.data_spec)
        self.button.disabled = True
        self.status.value = f"running {html.escape(new.parallel.describe())} on {exp.cluster.world_size} ranks…"
        began = time.perf_counter()
        try:
            self.result = self._train_on(new) if self.keep_weights.value else new.run()
        except Exception as error:
            self.status.value = f"<span class='cl-failed'>failed: {html.escape(str(error).splitlines()[0])}</span>"
            raise
        finally:
            self.button.disabled = exp.cluster.stopped
        losses, reference = self._losses_beside_reference()
        self.status.value = f"done in {time.perf_counter() - began:.1f} s"
        self.losses.value = _loss_table_html(losses, reference)
        self.sharding.set_layout(self.result.layout)
        self._refresh_measured(self.result)
        return self.result

    def _train_on(self, new: Experiment) -> RunResult:
        """Keep weights: the kept Training moved to ``new``'s layout (built on the first Run), then ``steps`` more."""
        options = dict(trace=new.trace, synthetic_forward_s=new.synthetic_forward_s, measure=new.measure)
        if self.training is None:
            self.training = Training(new.cluster, new.model, new.parallel, global_batch=new.global_batch, lr=new.lr,
                                     optimizer=new.optimizer, seed=new.seed, compile=new.compile, data=new.data_spec,
                                     **options)
        elif self.training.parallel != new.parallel:
            self.training.relayout(new.parallel, **options)
        return self.training.step(new.steps)

    def _drop_training(self) -> None:
        training, self.training = self.training, None
        if training is not None:
            training.close()

    def _losses_beside_reference(self) -> tuple[list[float], list[float]]:
        """This run's losses (with kept weights: every step so far) and one process's over as many steps."""
        exp = self.exp
        losses = self.training.losses if self.training is not None else self.result.losses
        if self._reference is None or len(self._reference.losses) != len(losses):
            self._reference = Experiment(exp.cluster, exp.model, exp.parallel, global_batch=exp.global_batch,
                                         steps=len(losses), lr=exp.lr, optimizer=exp.optimizer, seed=exp.seed,
                                         data=exp.data_spec).reference()
        return losses, self._reference.losses

    def _refresh_measured(self, result: RunResult) -> None:
        """The timeline and memory views follow the run; one the run did not record is hidden, not stale."""
        if result.events:
            self.timeline.update(result.events, result.bubble or None,
                                 {rank: acts for rank, acts in enumerate(result.planned) if acts})
        if result.memory_records or result.memory_timeline:
            self.memory.update(result.memory_records, result.memory_timeline)
        self.timeline.layout.display = None if result.events else "none"
        self.memory.layout.display = None if result.memory_records or result.memory_timeline else "none"

    def _views_shown(self) -> list[Any]:
        """The views under the controls that show something: none before a run, else sharding and those it recorded."""
        views = (self.sharding, self.timeline, self.memory)
        return [] if self.result is None else [v for v in views if v.layout.display != "none"]

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """The controls, live; read without a kernel, the form and the views under it as one figure."""
        png = stack_pngs([note_png(repr(self))] + [v.static_png() for v in self._views_shown()])
        return with_static(self.widget._repr_mimebundle_(**kwargs), type(self).__name__, repr(self), png)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={field.value}" for name, field in self.fields.items())
        if self.result is None:
            return f"Controls on {self.exp.cluster.world_size} ranks, set to {shown}: not run yet"
        return (f"Controls on {self.exp.cluster.world_size} ranks, set to {shown}: the last run's loss "
                f"{self.result.losses[-1]:.4f} after {len(self.result.losses)} steps")

def _loss_table_html(losses: list[float], reference: list[float]) -> str:
    rows = "".join(f"<tr><td>{i}</td><td>{a:.6f}</td><td>{b:.6f}</td><td>{abs(a - b) / abs(b):.1e}</td></tr>"
                   for i, (a, b) in enumerate(zip(losses, reference)))
    same = len(losses) == len(reference) and all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses, reference))
    verdict = "equal to one process" if same else "DIFFERENT from one process"
    return (f"<table class='cl-losses'><tr><th>step</th><th>loss</th><th>one process</th><th>rel. diff</th></tr>"
            f"{rows}</table><p>{html.escape(verdict)}</p>")
