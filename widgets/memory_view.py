"""MemoryView: what each rank holds, by category, measured beside predicted (docs/design.md#memory-categories).

Input: ``kernels.contract.measure_records.MemoryRecord`` records or their ``to_dict()`` dicts (checked by
``MemoryRecord.from_dict``), in bytes, with moment ``at_rest`` | ``peak_fwd_bwd`` and category
``params`` | ``grads`` | ``optimizer`` | ``activations`` | ``cuda_allocated`` and ``cuda_workspaces`` (not drawn: the
allocator's view of the same tensors, and cuBLAS's part of it) | ``cuda_max_allocated`` |
``activations.<part>`` (the activations again,
split by the part of the model that saved them: a table under the rank, ``.cl-mem-parts``, not a bar, each part
measured beside the lab GPT's rule of ``kernels.contract.activation_rules`` where it holds, with the source of each number)
(any other category counts as ``other``). On GPU, ``other`` also takes what
``torch.cuda.max_memory_allocated`` saw beyond the four categories (workspaces, temporaries).

One ``.cl-mem-rank`` per rank: a measured bar of ``.cl-mem-seg[data-category]`` segments
beside a ``.cl-mem-predicted`` bar (the exact rule; activations have no prediction) and a
``.cl-mem-formula`` tick at the ZeRO formula of docs/design.md#zero-formulas. ``moment`` picks the moment.
"""
from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from kernels.contract.measure_records import MemoryRecord
from widgets._esm import view_module
from widgets._memory_strip import draw_strip, fmt_bytes, strip_state
from widgets.static_figure import StaticFigure

CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state", "activations": "activations",
          "other": "other"}
COLORS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f", "activations": "#e15759", "other": "#bab0ac"}
MOMENTS = ("at_rest", "peak_fwd_bwd")
PART_PREFIX = "activations."  # activations.attention, .mlp, ...: kernels/measure/activation_parts.py


def _add(into: dict[str, Any], key: str, value: float | None) -> None:
    if value is not None:
        into[key] = (into.get(key) or 0) + value


def _bar(rank: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank at one moment: bytes per category (measured, predicted, formula), totals and notes."""
    measured: dict[str, Any] = dict.fromkeys(CATEGORIES, 0)
    predicted: dict[str, Any] = {}
    formula: dict[str, Any] = {}
    notes: dict[str, str] = {}
    parts: dict[str, Any] = {}
    cuda = None
    for r in rows:
        if r["category"].startswith(PART_PREFIX):  # the activations again, by part: a table, not a bar
            parts[r["category"][len(PART_PREFIX):]] = {"measured": r.get("measured"), "source": r.get("note", ""),
                                                       "predicted": r.get("predicted"),
                                                       "predicted_source": r.get("predicted_source", "")}
            continue
        if r["category"] == "cuda_max_allocated":
            cuda = r.get("measured")
            continue
        if r["category"] in ("cuda_allocated", "cuda_workspaces"):  # the allocator's view: not a bar of its own
            continue
        cat = r["category"] if r["category"] in CATEGORIES else "other"
        _add(measured, cat, r.get("measured"))
        _add(predicted, cat, r.get("predicted"))
        _add(formula, cat, r.get("formula"))
        if r.get("note"):
            notes[cat] = "; ".join(filter(None, [notes.get(cat), r["note"]]))
    if cuda is not None:
        beyond = max(0, cuda - sum(measured.values()))
        measured["other"] += beyond
        notes["other"] = "; ".join(filter(None, [notes.get("other"), f"{beyond} B more in cuda max allocated"]))
    return {"rank": rank, "measured": measured, "predicted": predicted, "formula": formula, "notes": notes,
            "total": sum(measured.values()), "predicted_total": sum(predicted.values()) if predicted else None,
            "formula_total": sum(formula.values()) if formula else None, "cuda_max_allocated": cuda,
            "activation_parts": parts}


def _memory_state(records: Any) -> dict[str, Any]:
    """{ranks, moments, categories, bars: {moment: [bar per rank]}, scale}: what MemoryView draws, JSON-only."""
    rows = [MemoryRecord.coerce(r).to_dict() for r in records]
    found = {r["moment"] for r in rows}
    moments = [m for m in MOMENTS if m in found] + sorted(found - set(MOMENTS))
    ranks = sorted({r["rank"] for r in rows})
    bars = {m: [_bar(k, [r for r in rows if r["rank"] == k and r["moment"] == m]) for k in ranks] for m in moments}
    scale = max([v for bs in bars.values() for b in bs
                 for v in (b["total"], b["predicted_total"], b["formula_total"]) if v] or [1])
    return {"ranks": ranks, "moments": moments, "categories": list(CATEGORIES), "bars": bars, "scale": scale}


class MemoryView(StaticFigure, anywidget.AnyWidget):
    """Stacked bars per rank for one moment (``.cl-mem-moment`` buttons switch), measured beside predicted."""

    _esm = view_module("memory_strip.js", "memory_view.js")

    ranks = traitlets.List().tag(sync=True)
    moments = traitlets.List().tag(sync=True)  # present in the records, at_rest first
    categories = traitlets.List().tag(sync=True)  # stacking order, bottom up
    bars = traitlets.Dict().tag(sync=True)  # moment -> [_bar(...) per rank]
    scale = traitlets.Float(1.0).tag(sync=True)  # bytes at full bar height, the same for every moment
    moment = traitlets.Unicode("at_rest").tag(sync=True)
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts, colour-blind-safe high-contrast palette
    strip = traitlets.Dict().tag(sync=True)  # widgets._memory_strip.strip_state: memory over the traced step

    def __init__(self, records: Any = None, moment: str = "at_rest", timeline: Any = None, **kwargs: Any) -> None:
        state = _memory_state(records or [])
        if state["moments"] and moment not in state["moments"]:
            raise ValueError(f"moment {moment!r} not in the records; have {state['moments']}")
        self._drawn = (records or [], timeline)  # what plot_memory draws the static figure from
        super().__init__(**state, moment=moment, strip=strip_state(timeline), **kwargs)

    def update(self, records: Any, timeline: Any = None) -> None:
        """Show another run's records (one message); the moment stays if the new records have it."""
        state = {**_memory_state(records), "strip": strip_state(timeline)}
        self._drawn = (records, timeline)
        with self.hold_sync():
            for key, value in state.items():
                setattr(self, key, value)
            if state["moments"] and self.moment not in state["moments"]:
                self.moment = state["moments"][0]

    def static_figure(self) -> Any:
        """``plot_memory`` at the moment shown, with the over-time strip where there is one."""
        records, timeline = self._drawn
        return plot_memory(records, self.moment, timeline) if self.moments or self.strip.get("rows") else None

    def static_text(self) -> str:
        """The moment, the ranks and the largest total measured beside its prediction."""
        bars = self.bars.get(self.moment, [])
        if not bars:
            return "memory over the traced step, per rank" if self.strip.get("rows") else "no memory records"
        top = max(bars, key=lambda b: b["total"])
        predicted = "" if top["predicted_total"] is None else f", predicted {fmt_bytes(top['predicted_total'])}"
        return (f"memory per rank and category at {self.moment}, {len(bars)} ranks: largest measured "
                f"{fmt_bytes(top['total'])} on rank {top['rank']}{predicted}")


BINARY_UNITS = (("B", 1), ("KiB", 2 ** 10), ("MiB", 2 ** 20), ("GiB", 2 ** 30), ("TiB", 2 ** 40))


def _unit(scale: float) -> tuple[str, float]:
    """The largest binary unit the scale reaches, as the browser's axis picks it (static/memory_view.js ticks)."""
    return [u for u in BINARY_UNITS if scale / u[1] >= 1][-1] if scale >= 1 else BINARY_UNITS[0]


def plot_memory(records: Any, moment: str = "at_rest", timeline: Any = None):
    """Static fallback with the browser's labels: per rank a measured stacked bar (gid ``measured:<category>``)
    beside the predicted one (hatched, gid ``predicted:<category>``, only categories with a prediction), the ZeRO
    formula dashed; the y axis in bytes, in the binary unit the browser's axis uses. With ``timeline``
    (``RunResult.memory_timeline``) the over-time strip follows, one row per rank (``widgets._memory_strip``)."""
    from matplotlib.figure import Figure

    state, strip = _memory_state(records or []), strip_state(timeline)
    if state["moments"] and moment not in state["bars"]:
        raise ValueError(f"moment {moment!r} not in the records; have {state['moments']}")
    bars = state["bars"].get(moment, [])
    parts = any(b["activation_parts"] for b in bars)  # a table of parts under each rank needs room
    heights = ([4.3 if parts else 3.2] if bars else []) + [0.9] * len(strip["rows"])
    fig = Figure(figsize=(max(6.0 if strip["rows"] else 4.0, (2.2 if parts else 1.1) * len(bars) + 3),
                          sum(heights) + 0.4))
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights) if heights else None
    if bars:
        _plot_bars(fig.add_subplot(grid[0]), bars, state["scale"], moment)
    if strip["rows"]:
        draw_strip(fig, [grid[i] for i in range(len(heights) - len(strip["rows"]), len(heights))], strip, COLORS,
                   LABELS, _unit(strip["scale"]))
    fig.tight_layout()
    return fig


def _plot_bars(ax: Any, bars: list[dict[str, Any]], scale: float, moment: str) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    unit, mib = _unit(scale)
    for i, b in enumerate(bars):
        low = high = 0.0
        for cat in CATEGORIES:
            ax.bar(i - 0.2, b["measured"][cat] / mib, 0.38, bottom=low, color=COLORS[cat], gid=f"measured:{cat}",
                   label=LABELS[cat] if i == 0 else None)
            low += b["measured"][cat] / mib
            if cat in b["predicted"]:
                ax.bar(i + 0.2, b["predicted"][cat] / mib, 0.38, bottom=high, color=COLORS[cat], alpha=0.45,
                       hatch="//", edgecolor="black", linewidth=0.4, gid=f"predicted:{cat}")
                high += b["predicted"][cat] / mib
        if b["formula_total"]:
            ax.hlines(b["formula_total"] / mib, i + 0.01, i + 0.39, colors="black", linestyles="dashed",
                      gid="formula")
        _annotate_parts(ax, i, b)
    ax.set_xticks(range(len(bars)), [f"rank {b['rank']}" for b in bars], fontsize=7)
    ax.set_xlabel("per rank: measured (left) | predicted (right)", fontsize=7, labelpad=2)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(f"memory per rank at {moment}: measured beside predicted", fontsize=9)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(facecolor="white", edgecolor="black", hatch="//", label="predicted (hatched)"),
                Line2D([], [], color="black", linestyle="dashed", label="ZeRO formula (dashed)")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)


def _annotate_parts(ax: Any, i: int, b: dict[str, Any]) -> None:
    """The browser's ``.cl-mem-parts`` table as text under the rank: activations by part, measured | predicted."""
    parts = sorted(b["activation_parts"].items(), key=lambda kv: -(kv[1]["measured"] or 0))
    if not parts:
        return
    lines = ["activations by part: measured | predicted"] + [
        f"{p}: {fmt_bytes(v['measured'])} | {'no rule' if v['predicted'] is None else fmt_bytes(v['predicted'])}"
        for p, v in parts]
    ax.text(i, -0.2, "\n".join(lines), transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=6.5,
            gid=f"parts:{b['rank']}")
