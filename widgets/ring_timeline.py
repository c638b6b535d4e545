"""RingTimeline: one ring-attention call (context parallelism) in one training step, one lane per rank.

Input: ``kernels.contract.expert_context_records.RingStep`` records or their ``to_dict()`` dicts (checked by
``from_dict``), one per rank, ring step, step and layer: the forward of one call. ``ring_lanes`` turns one
(step, layer) into what both the widget and ``plot_ring`` draw: per rank, per ring step, a compute box labelled
with the owner of the key/value block it attended (``kv_rank``), then the wait for the next block, and beside
the compute the transfer that overlaps it: the block sent on to the next cp rank (``sent_bytes``), posted when
the compute began and there by the end of the wait.

Times are each rank's own clock from the call's start (no clock alignment is needed: a lane is one rank).
What a record contradicts is said in red, never dropped: a ring step missing or doubled, or a ``kv_rank``
that is not ``(cp_rank - ring_step) mod cp``.
"""
from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from kernels.contract.expert_context_records import RingStep
from widgets._esm import view_module
from widgets._memory_strip import fmt_bytes
from widgets._step_layer import StepLayerView, choose

_STATIC = pathlib.Path(__file__).parent / "static"
COMPUTE, WAIT, TRANSFER = "#4e79a7", "#c0392b", "#e08a1e"  # as in static/ring_timeline.css


def step_problem(r: RingStep) -> str | None:
    """What one ring step contradicts on its own: the owner of the block it should have attended."""
    expected = (r.cp_rank - r.ring_step) % r.cp
    if r.kv_rank != expected:
        return (f"rank {r.rank} ring step {r.ring_step}: kv_rank {r.kv_rank} != (cp_rank {r.cp_rank} - ring_step) "
                f"mod {r.cp} = {expected}")
    return None


def _lane(rank: int, steps: list[RingStep]) -> dict[str, Any]:
    """One rank's ring steps in ms from its call's start, with its sums."""
    boxes = [{"ring_step": r.ring_step, "kv_rank": r.kv_rank, "start_ms": r.start_s * 1e3,
              "compute_ms": r.compute_s * 1e3, "wait_ms": r.wait_s * 1e3, "sent_bytes": r.sent_bytes,
              "to_cp_rank": (r.cp_rank + 1) % r.cp, "chunk_pairs": r.chunk_pairs} for r in steps]
    end = max((b["start_ms"] + b["compute_ms"] + b["wait_ms"] for b in boxes), default=0.0)
    wait = sum(b["wait_ms"] for b in boxes)
    return {"rank": rank, "cp_rank": steps[0].cp_rank, "boxes": boxes, "end_ms": end, "wait_ms": wait,
            "compute_ms": sum(b["compute_ms"] for b in boxes), "wait_share": wait / end if end else 0.0,
            "sent_bytes": sum(b["sent_bytes"] for b in boxes), "chunk_pairs": sum(b["chunk_pairs"] for b in boxes)}


def ring_lanes(records: Sequence[Any], step: int | None = None, layer: str | None = None) -> dict[str, Any]:
    """Everything RingTimeline and plot_ring draw for one (step, layer), JSON-only: ``lanes`` (per rank, in rank
    order: ``boxes`` per ring step with ``start_ms``, ``compute_ms``, ``wait_ms``, ``kv_rank``, ``sent_bytes``,
    ``to_cp_rank``, ``chunk_pairs``; and the lane's ``end_ms``, ``wait_ms``, ``wait_share``, ``sent_bytes``,
    ``chunk_pairs``), ``span_ms``, ``cp``, ``wait_share`` (all ranks' waits over all ranks' call times),
    ``ok``, ``problems``, ``header`` and ``disagree_at`` ([step, layer] pairs of all the records with a
    ``kv_rank`` off the ring). ``step`` None: the last; ``layer`` None: the first."""
    checked = [RingStep.coerce(r) for r in records]
    pick = choose(checked, step, layer)
    by_rank: dict[int, list[RingStep]] = {}
    for r in sorted(pick["rows"], key=lambda r: (r.rank, r.ring_step)):
        by_rank.setdefault(r.rank, []).append(r)
    cps = {r.cp for r in pick["rows"]}
    problems = [p for r in pick["rows"] if (p := step_problem(r))]
    if len(cps) > 1:
        problems.append(f"ranks disagree on cp: {sorted(cps)}")
    for rank, steps in by_rank.items():
        if [r.ring_step for r in steps] != list(range(steps[0].cp)):
            problems.append(f"rank {rank}: ring steps {[r.ring_step for r in steps]} for cp={steps[0].cp}")
    lanes = [_lane(rank, steps) for rank, steps in sorted(by_rank.items())]
    ends = sum(lane["end_ms"] for lane in lanes)
    view = {"step": pick["step"], "layer": pick["layer"], "steps": pick["steps"], "layers": pick["layers"],
            "cp": max(cps, default=1), "lanes": lanes, "span_ms": max((lane["end_ms"] for lane in lanes), default=0.0),
            "wait_share": sum(lane["wait_ms"] for lane in lanes) / ends if ends else 0.0,
            "ok": not problems, "problems": problems,
            "disagree_at": [list(p) for p in sorted({(r.step, r.layer) for r in checked if step_problem(r)})]}
    return {**view, "header": _header(view)}


def _spread(values: list[int], say: Callable[[int], str]) -> str:
    """One value where all lanes agree, else the range."""
    return say(values[0]) if len(set(values)) == 1 else f"{say(min(values))} to {say(max(values))}"


def _header(view: dict[str, Any]) -> str:
    """The title in words: bytes each rank sent, the share of time waiting, the chunk pairs, and any problem."""
    lanes = view["lanes"]
    if not lanes:
        return "no ring-attention records"
    pairs = [lane["chunk_pairs"] for lane in lanes]
    said = (f"step {view['step']} · {view['layer']} · cp={view['cp']}: sent "
            f"{_spread([lane['sent_bytes'] for lane in lanes], fmt_bytes)} per rank · waiting "
            f"{view['wait_share']:.0%} of the call time (all ranks) · chunk pairs per rank {_spread(pairs, str)}"
            + (" (balanced)" if len(set(pairs)) == 1 else " (unbalanced)"))
    return said if view["ok"] else said + "\nMISMATCH: " + "; ".join(view["problems"])


class RingTimeline(StepLayerView):
    """One ``.cl-cp-lane`` per rank: ``.cl-cp-compute`` boxes (data-ring-step, data-kv-rank, labelled ``kv <rank>``),
    ``.cl-cp-wait`` after each, a ``.cl-cp-transfer`` arrow above the compute it overlaps; the header
    (``.cl-cp-head``, ``.cl-cp-mismatch`` on a problem) and step/layer selectors (``.cl-cp-step``, ``.cl-cp-layer``).
    ``RingTimeline(records, step=None, layer=None)``; ``view`` holds ``ring_lanes(records, step, layer)``."""

    _esm = view_module("step_layer.js", "ring_timeline.js")
    _css = _STATIC / "ring_timeline.css"
    record_type = RingStep
    derive = staticmethod(ring_lanes)
    twin = staticmethod(lambda records, step, layer: plot_ring(records, step, layer))  # plot_ring comes below

    def static_text(self) -> str:
        """The header of the view: it names the step and layer itself."""
        return self.view.get("error") or self.view["header"]


def plot_ring(records: Sequence[Any], step: int | None = None, layer: str | None = None):
    """Static twin of RingTimeline: per rank a lane of compute boxes (gid ``compute``, labelled ``kv <rank>``, gid
    ``label``), wait boxes after them (gid ``wait``, hatched) and above each compute the transfer of the block sent
    on (an arrow, gid ``transfer``, with its bytes); the header as the title, red where a record disagrees."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    view = ring_lanes(records, step, layer)
    lanes, span = view["lanes"], view["span_ms"] or 1.0
    fig = Figure(figsize=(10, 0.75 * len(lanes) + 1.8))
    ax = fig.add_subplot()
    for y, lane in enumerate(lanes):
        for b in lane["boxes"]:
            start, computed = b["start_ms"], b["start_ms"] + b["compute_ms"]
            ax.add_patch(Rectangle((start, y - 0.3), b["compute_ms"], 0.55, facecolor=COMPUTE, edgecolor="white",
                                   gid="compute"))
            ax.text((start + computed) / 2, y - 0.02, f"kv {b['kv_rank']}", ha="center", va="center", fontsize=7,
                    color="white", gid="label")
            if b["wait_ms"] > 0:
                ax.add_patch(Rectangle((computed, y - 0.3), b["wait_ms"], 0.55, facecolor="white", edgecolor=WAIT,
                                       hatch="////", linewidth=0.4, gid="wait"))
            if b["sent_bytes"]:
                ax.add_patch(FancyArrowPatch((start, y - 0.38), (computed + b["wait_ms"], y - 0.38),
                                             arrowstyle="-|>", mutation_scale=7, color=TRANSFER, linewidth=1,
                                             gid="transfer"))
                ax.text(start + 0.01 * span, y - 0.42, f"→ cp {b['to_cp_rank']}: {fmt_bytes(b['sent_bytes'])}",
                        ha="left", va="bottom", fontsize=6, color=TRANSFER, gid="transfer_label")
    ax.set_yticks(range(len(lanes)), [f"rank {lane['rank']} (cp {lane['cp_rank']})\nwaiting {lane['wait_share']:.0%}"
                                      for lane in lanes], fontsize=7)
    ax.set_xlim(0, span * 1.02)
    ax.set_ylim(len(lanes) - 0.5, -0.75)
    ax.set_xlabel("ms from the call's start, each rank's own clock", fontsize=7)
    ax.set_title(view["header"], fontsize=8, color="black" if view["ok"] else WAIT)
    ax.legend(handles=[Patch(facecolor=COMPUTE, label="compute on the kv block of rank n"),
                       Patch(facecolor="white", edgecolor=WAIT, hatch="////", label="waiting for the next block"),
                       Patch(facecolor=TRANSFER, label="block sent on to the next cp rank (in flight until done)")],
              fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    fig.tight_layout()
    return fig
