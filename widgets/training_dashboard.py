"""TrainingDashboard: every rank of a run at once, live or replayed, from ``StepProgress`` records.

Input: ``kernels.contract.watch_records.StepProgress`` records or their dicts (checked with
``from_dict``), plus, while a run goes, when the driver last heard from each rank. Shown:
the loss per step; per rank a strip of step times (one cell per step, darker = slower),
compute against waiting in collectives, memory, and the age of the last record, which
turns red (``data-stale``) past ``stale_after`` seconds; in the head line, the run's tokens/s and,
given the model's FLOPs per token and a device's peak, its MFU (``speed``). Compute and waiting are each rank's
median over its recent steps, and the ranks whose compute stands out are marked stragglers,
both by ``kernels.contract.stragglers`` (the rule ``RunResult.stragglers()`` applies to the
same records). A finished run (``RunResult.progress``)
replays in the same view: ``TrainingDashboard.replay(records)``.
"""
from __future__ import annotations

import pathlib
import time
from typing import Any

import anywidget
import traitlets

from kernels.contract.stragglers import stragglers, typical
from kernels.contract.watch_records import StepProgress
from widgets._esm import view_module
from widgets.static_figure import StaticFigure

_STATIC = pathlib.Path(__file__).parent / "static"


def rank_rows(records: list[Any], world_size: int, heard_at: list[float | None] | None = None,
              now: float | None = None, stale_after: float = 5.0, finished: bool = False) -> list[dict[str, Any]]:
    """One summary per rank: last step, recent compute and wait, memory, age of its last record, stale, straggler."""
    by_rank: dict[int, list[StepProgress]] = {r: [] for r in range(world_size)}
    for record in (StepProgress.coerce(r) for r in records):
        by_rank.setdefault(record.rank, []).append(record)
    now = time.time() if now is None else now
    rows = []
    for rank, mine in sorted(by_rank.items()):
        mine.sort(key=lambda r: r.step)
        heard = (heard_at or [])[rank] if heard_at and rank < len(heard_at) else None
        age = None if heard is None else max(0.0, now - heard)
        rows.append({"rank": rank, "step": mine[-1].step if mine else None,
                     "step_s": [r.step_s for r in mine],
                     "compute_s": typical({r.step: r.compute_s for r in mine}),
                     "collective_s": typical({r.step: r.collective_s for r in mine}),
                     "memory_bytes": mine[-1].memory_bytes if mine else None,
                     "memory_kind": mine[-1].memory_kind if mine else "",
                     "heard_at": heard, "age_s": age,
                     "stale": not finished and age is not None and age > stale_after,
                     "straggler": False})
    slow = stragglers({row["rank"]: row["compute_s"] for row in rows if row["step"] is not None})
    for row in rows:
        row["straggler"] = row["rank"] in slow
    return rows


def speed(records: list[Any], world_size: int, flops_per_token: float | None = None,
          peak_flops: float | None = None) -> dict[str, float | None]:
    """The run's tokens/s (each step's slowest rank, typical over the recent steps) and, given the model's
    FLOPs per token and one device's peak FLOP/s, its MFU (docs/design.md#overlap-model-flops-and-mfu)."""
    slowest: dict[int, float] = {}
    for record in (StepProgress.coerce(r) for r in records):
        slowest[record.step] = min(slowest.get(record.step, record.tokens_per_s), record.tokens_per_s)
    rate = typical(slowest)
    mfu = rate * flops_per_token / (peak_flops * world_size) if rate and flops_per_token and peak_flops else None
    return {"tokens_per_s": rate if slowest else None, "mfu": mfu}


def losses(records: list[Any]) -> list[list[float]]:
    """[step, loss] pairs (the global-batch loss: the same on every rank; the lowest rank's is kept)."""
    out: dict[int, tuple[int, float]] = {}
    for record in (StepProgress.coerce(r) for r in records):
        if record.step not in out or record.rank < out[record.step][0]:
            out[record.step] = (record.rank, record.loss)
    return [[step, loss] for step, (_, loss) in sorted(out.items())]


class TrainingDashboard(StaticFigure, anywidget.AnyWidget):
    """All ranks of one run: ``.cl-dash-rank`` rows (``data-rank``, ``data-stale``, ``data-straggler``), a loss chart."""

    _esm = view_module("training_dashboard.js")
    _css = _STATIC / "training_dashboard.css"

    world_size = traitlets.Int(0).tag(sync=True)
    steps = traitlets.Int(0).tag(sync=True)
    stale_after = traitlets.Float(5.0).tag(sync=True)
    finished = traitlets.Bool(False).tag(sync=True)
    loss = traitlets.List().tag(sync=True)  # [[step, loss]]
    ranks = traitlets.List().tag(sync=True)  # rank_rows(...)
    clock = traitlets.Float(0.0).tag(sync=True)  # the driver's wall clock when ranks was computed
    speed = traitlets.Dict().tag(sync=True)  # speed(...): tokens_per_s, mfu (None without a peak)

    def __init__(self, records: list[Any] | None = None, *, world_size: int, steps: int = 0, stale_after: float = 5.0,
                 heard_at: list[float | None] | None = None, finished: bool = False,
                 flops_per_token: float | None = None, peak_flops: float | None = None, **kwargs: Any) -> None:
        self._records = [StepProgress.coerce(r) for r in records or []]
        self._flops = (flops_per_token, peak_flops)  # the model's FLOPs per token, one device's peak FLOP/s
        now = time.time()
        super().__init__(world_size=world_size, steps=steps, stale_after=stale_after, finished=finished,
                         loss=losses(self._records), clock=now, speed=speed(self._records, world_size, *self._flops),
                         ranks=rank_rows(self._records, world_size, heard_at, now, stale_after, finished), **kwargs)

    @classmethod
    def replay(cls, records: list[Any], *, world_size: int | None = None, steps: int = 0,
               flops_per_token: float | None = None, peak_flops: float | None = None) -> "TrainingDashboard":
        """A finished run's view from its saved records (``RunResult.progress``)."""
        parsed = [StepProgress.coerce(r) for r in records]
        size = world_size if world_size is not None else 1 + max((r.rank for r in parsed), default=-1)
        return cls(parsed, world_size=size, steps=steps or max((r.steps for r in parsed), default=0), finished=True,
                   flops_per_token=flops_per_token, peak_flops=peak_flops)

    def add(self, records: list[Any], heard_at: list[float | None] | None = None) -> None:
        """Show new records (and when each rank was last heard from)."""
        self._records += [StepProgress.coerce(r) for r in records]
        self._redraw(heard_at)

    def finish(self, heard_at: list[float | None] | None = None) -> None:
        """The run ended: ages stop counting and nothing is stale."""
        self.finished = True
        self._redraw(heard_at)

    def _redraw(self, heard_at: list[float | None] | None) -> None:
        now = time.time()
        with self.hold_sync():
            self.clock = now
            self.loss = losses(self._records)
            self.speed = speed(self._records, self.world_size, *self._flops)
            self.ranks = rank_rows(self._records, self.world_size, heard_at, now, self.stale_after, self.finished)

    @property
    def records(self) -> list[StepProgress]:
        """Every record shown."""
        return list(self._records)

    def static_figure(self) -> Any:
        """``plot_dashboard`` of the records so far (a live run's display shows those it had then)."""
        return plot_dashboard(self._records, self.world_size) if self._records else None

    def static_text(self) -> str:
        """The ranks, how far the run got, its last loss and its speed."""
        if not self.loss:
            return f"{self.world_size} ranks, no step finished yet"
        step, loss = self.loss[-1]
        rate = self.speed.get("tokens_per_s")
        return (f"{self.world_size} ranks, step {step + 1} of {self.steps or '?'}"
                f"{' (finished)' if self.finished else ''}: loss {loss:.4f}"
                + ("" if rate is None else f", {rate:,.0f} tokens/s"))


def plot_dashboard(records: list[Any], world_size: int | None = None):
    """Static fallback: loss per step, step time per rank and step (heat map), compute against waiting per rank."""
    from matplotlib.figure import Figure

    parsed = [StepProgress.coerce(r) for r in records]
    size = world_size if world_size is not None else 1 + max((r.rank for r in parsed), default=-1)
    rows = rank_rows(parsed, size, finished=True)
    fig = Figure(figsize=(10, 2.8))
    ax_loss, ax_heat, ax_split = fig.subplots(1, 3)
    pairs = losses(parsed)
    ax_loss.plot([s for s, _ in pairs], [v for _, v in pairs], marker=".")
    ax_loss.set(title="loss", xlabel="step")
    steps = max((len(row["step_s"]) for row in rows), default=0)
    grid = [[1e3 * t for t in row["step_s"]] + [float("nan")] * (steps - len(row["step_s"])) for row in rows]
    image = ax_heat.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax_heat, label="ms")
    ax_heat.set(title="step time per rank", xlabel="step", ylabel="rank")
    ranks = [row["rank"] for row in rows]
    compute = [1e3 * row["compute_s"] for row in rows]
    ax_split.barh(ranks, compute, color="#2f6fd0", label="compute")
    ax_split.barh(ranks, [1e3 * row["collective_s"] for row in rows], left=compute, color="#e0a030",
                  label="waiting in collectives")
    ax_split.set(title="per step (recent median)", xlabel="ms", ylabel="rank")
    ax_split.invert_yaxis()
    ax_split.legend(fontsize=7)
    fig.tight_layout()
    return fig
