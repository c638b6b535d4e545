"""The peak-over-time strip of MemoryView: what each rank held after each action of the traced step.

Input: ``kernels.contract.measure_records.MemorySample`` records or dicts (``RunResult.memory_timeline``), measured on
the ranks by ``kernels.measure.memory_timeline``. The state is JSON only, one row per rank: sample times in ms
from the step's first sample, the four categories' bytes stacked in MemoryView's order, a short label
per sample ("F mb3 s1", "optimizer") and the rank's peak. Every rank shares one time axis and one
byte scale, so the strips can be read against each other. ``draw_strip`` is the matplotlib twin of
static/memory_strip.js (same title, labels and legend).
"""
from __future__ import annotations

from typing import Any

from kernels.contract.measure_records import MemorySample

STACK = ("params", "grads", "optimizer", "activations")  # bottom up, as MemoryView's bars
TITLE = "memory over the traced step, per rank (measured after each action)"
X_LABEL = "time in the traced step (ms)"


def fmt_bytes(v: float | None) -> str:
    """Bytes as the browser's views write them (static/memory_view.js ``bytes``): "986.96 KiB", "600 B", "n/a"."""
    if v is None:
        return "n/a"
    units, k = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(v) >= 1024 and k < len(units) - 1:
        v, k = v / 1024, k + 1
    return f"{v:.2f} {units[k]}" if k else f"{v:g} B"


def sample_label(s: dict[str, Any]) -> str:
    """What the rank had just done: "F mb3 s1" for a compute action, else its kind ("optimizer", "start")."""
    if s["action"]:
        return f"{s['action']} mb{s['microbatch']} s{s['stage']}"
    return s["kind"].replace("_", " ")


def strip_state(samples: Any) -> dict[str, Any]:
    """{ranks, span_ms, scale, rows: [{rank, t, stack: {category: [bytes]}, labels, peak}]} (module docstring)."""
    rows = [MemorySample.coerce(s).to_dict() for s in samples or []]
    if not rows:
        return {"ranks": [], "span_ms": 0.0, "scale": 0, "rows": []}
    t0 = min(r["t"] for r in rows)
    out = []
    for rank in sorted({r["rank"] for r in rows}):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["t"])
        totals = [sum(r[c] for c in STACK) for r in mine]
        top = max(range(len(mine)), key=lambda i: totals[i])
        out.append({"rank": rank, "t": [round((r["t"] - t0) * 1e3, 3) for r in mine],
                    "stack": {c: [r[c] for r in mine] for c in STACK}, "labels": [sample_label(r) for r in mine],
                    "peak": {"bytes": totals[top], "index": top, "label": sample_label(mine[top])}})
    span = max(max(r["t"]) for r in out) or 1.0
    return {"ranks": [r["rank"] for r in out], "span_ms": span, "scale": max(r["peak"]["bytes"] for r in out),
            "rows": out}


def draw_strip(fig: Any, grid: Any, state: dict[str, Any], colors: dict[str, str], labels: dict[str, str],
               unit: tuple[str, float]) -> None:
    """One axes per rank in ``grid`` (a GridSpec cell list): stacked steps (gid ``strip:<rank>:<category>``) and
    the peak marked (gid ``strip-peak:<rank>``), on the shared time axis and byte scale."""
    name, size = unit
    axes = []
    for i, row in enumerate(state["rows"]):
        ax = fig.add_subplot(grid[i], sharex=axes[0] if axes else None)
        axes.append(ax)
        t = row["t"] + [state["span_ms"]]
        low = [0.0] * len(t)
        for cat in STACK:
            values = [v / size for v in row["stack"][cat]]
            high = [a + b for a, b in zip(low, values + values[-1:])]
            ax.fill_between(t, low, high, step="post", color=colors[cat], linewidth=0, gid=f"strip:{row['rank']}:{cat}",
                            label=labels[cat] if i == 0 else None)
            low = high
        k = row["peak"]["index"]
        ax.plot([row["t"][k]], [row["peak"]["bytes"] / size], marker="v", color="black", gid=f"strip-peak:{row['rank']}")
        ax.annotate(f"peak {fmt_bytes(row['peak']['bytes'])} after {row['peak']['label']}",
                    (row["t"][k], row["peak"]["bytes"] / size), fontsize=6, xytext=(3, -8), textcoords="offset points")
        ax.set_ylim(0, state["scale"] / size * 1.15)
        ax.set_ylabel(f"rank {row['rank']}\n({name})", fontsize=7)
        ax.tick_params(labelsize=6)
    if axes:
        axes[0].set_title(TITLE, fontsize=8)
        axes[-1].set_xlabel(X_LABEL, fontsize=7)
        axes[0].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
