"""What a plan predicted for a scaled-down copy of its model, beside what the pool measured (no torch).

``lab.plan(..., measure_on=cluster)`` (``lab.run.plan_on_pool``) runs a copy of the planned model, made
small through its own sizes, under the planned layout shrunk to the pool, and plans that copy at the
pool's size with the same code that planned the real one. Each row sets one predicted quantity beside
its measurement: per pipeline rank the parameters, gradients, optimizer state and activations of
its busiest rank, and per axis and collective the payload bytes one rank moves per step. A ratio
near 1 says the planner's formulas hold on the lab's real code for this layout; a ratio far from 1
names where the plan of the real model is to be doubted, and the note says what is known to differ.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class CheckRow:
    """One predicted quantity beside its measurement (bytes)."""

    what: str  # "pp rank 0 params", "rank 0 funcol all_reduce", ...
    predicted: float
    measured: float
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when nothing was predicted)."""
        return self.measured / self.predicted if self.predicted else None


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """The scaled copy that ran, where, and every row (module docstring)."""

    model: str  # the scaled copy, as the planner names it
    layout: str  # the layout it ran under, described
    world: int
    rows: tuple[CheckRow, ...]

    def worst(self) -> float:
        """The largest |measured / predicted - 1| over the model states and traffic (activations are left out:
        the planner estimates them, it does not count them)."""
        rows = [r for r in self.rows if r.ratio is not None and not r.what.endswith("activations")]
        return max((abs(r.ratio - 1) for r in rows), default=0.0)

    def table_rows(self) -> list[tuple[str, str, str, str, str]]:
        """(what, predicted, measured, ratio, note) as text."""
        return [(r.what, f"{r.predicted:,.0f}", f"{r.measured:,.0f}", "-" if r.ratio is None else f"{r.ratio:.3f}",
                 r.note) for r in self.rows]

    def title(self) -> str:
        return f"measured on {self.world} ranks: {self.model} under {self.layout}"
