"""Which training step and which layer a per-step, per-layer view shows (ExpertRouting, RingTimeline).

Both record kinds carry ``step`` and ``layer`` (a module name such as ``blocks.10.mlp``); a view shows one
pair at a time: by default the last step and the first layer in model order. ``StepLayerView`` is the widget
both views are: the browser's selectors (static/step_layer.js) write ``step`` / ``layer`` and the kernel
recomputes ``view`` from the records it keeps, so only one pair's numbers ever travel to the browser.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import anywidget
import traitlets

from widgets.static_figure import StaticFigure


def model_order(layer: str) -> tuple:
    """Sort key putting ``blocks.2`` before ``blocks.10`` (numbers compared as numbers)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", layer))


def choose(records: Sequence[Any], step: int | None, layer: str | None) -> dict[str, Any]:
    """The pair to show and what there is: ``{step, layer, steps, layers, rows}`` where ``rows`` are the
    records of that pair. ``step`` None: the last; ``layer`` None: the first layer the step has.
    A pair the records lack raises ValueError saying what they have."""
    steps = sorted({r.step for r in records})
    layers = sorted({r.layer for r in records}, key=model_order)
    chosen = steps[-1] if step is None and steps else step
    of_step = [r for r in records if r.step == chosen]
    if layer is None:
        layer = min((r.layer for r in of_step), key=model_order, default=None)
    rows = [r for r in of_step if r.layer == layer]
    if records and not rows:
        raise ValueError(f"no records for step {chosen} layer {layer!r}; steps {steps}, layers {layers}")
    return {"step": chosen, "layer": layer, "steps": steps, "layers": layers, "rows": rows}


class StepLayerView(StaticFigure, anywidget.AnyWidget):
    """A widget showing ``derive(records, step, layer)`` for the chosen pair; subclasses name the record type,
    ``derive``, its matplotlib ``twin`` and their front end."""

    record_type: ClassVar[type]  # the record type the input is checked against (records or their dicts)
    derive: ClassVar[Callable[[Sequence[Any], int | None, str | None], dict[str, Any]]]
    twin: ClassVar[Callable[[Sequence[Any], int | None, str | None], Any]]  # the static figure of one pair

    step = traitlets.Int(None, allow_none=True).tag(sync=True)  # the browser's selectors write these two
    layer = traitlets.Unicode(None, allow_none=True).tag(sync=True)
    view = traitlets.Dict().tag(sync=True)  # derive(records, step, layer), or {"error", "steps", "layers"}
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts

    def __init__(self, records: Sequence[Any] | None = None, step: int | None = None, layer: str | None = None,
                 **kwargs: Any) -> None:
        self._records = [self.record_type.coerce(r) for r in records or []]  # kept here: each choice recomputes
        view = type(self).derive(self._records, step, layer)
        super().__init__(step=view["step"], layer=view["layer"], view=view, **kwargs)

    @traitlets.observe("step", "layer")
    def _choice_changed(self, _change: dict) -> None:
        try:
            self.view = type(self).derive(self._records, self.step, self.layer)
        except ValueError as e:  # a pair the records lack: said on screen, beside the selectors
            self.view = {"error": str(e), "steps": self.view.get("steps", []), "layers": self.view.get("layers", [])}

    def static_figure(self) -> Any:
        """The twin of the pair shown."""
        if not self._records or "error" in self.view:  # nothing, or a pair the records lack: said in the text
            return None
        return type(self).twin(self._records, self.step, self.layer)

    def static_text(self) -> str:
        """The pair shown and its check, in words (the header of the view)."""
        if "error" in self.view:
            return self.view["error"]
        return f"step {self.step} · {self.layer}: {self.view['header']}" if self._records else "no records"
