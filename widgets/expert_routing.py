"""ExpertRouting: one MoE layer's routing in one training step, as the all-to-all matrix it makes.

Input: ``kernels.contract.expert_context_records.RoutingStep`` records or their ``to_dict()`` dicts (checked by
``from_dict``), one per rank, step and layer. ``routing_matrix`` turns one (step, layer) into what both the
widget and ``plot_routing`` draw:

- the matrix: rows = source ranks, columns = experts, cell = assignments that rank's router sent to that expert.
  Expert ``e`` lives on ep rank ``e // (E / ep)``, so the columns come grouped by the ep rank holding them;
  rows are grouped by the sender's ep rank the same way, so the diagonal blocks are assignments that stay on
  their rank and the off-diagonal blocks cross the wire;
- per expert the load (assigned, of which kept and dropped), the imbalance max/mean, the aux loss;
- the check every rank's row must pass: its assignments == its tokens x top_k, and no expert keeps more than it
  was assigned. A row that fails makes the header red and names the rank; it is drawn as measured.
"""
from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from kernels.contract.expert_context_records import RoutingStep
from widgets._esm import view_module
from widgets._step_layer import StepLayerView, choose

_STATIC = pathlib.Path(__file__).parent / "static"
NUMBERS_UP_TO_CELLS = 256  # beyond this many cells a count no longer fits its cell: colour only
LOCAL, REMOTE, DROPPED = "#2e7d32", "#2f6fd0", "#c62828"  # as in static/expert_routing.css


def row_problems(r: RoutingStep) -> list[str]:
    """What one rank's routing record contradicts: its assignment total, or an expert keeping more than it got."""
    out = []
    if sum(r.assigned) != r.tokens * r.top_k:
        out.append(f"rank {r.rank}: assigned {sum(r.assigned)} != tokens {r.tokens} × top_k {r.top_k} "
                   f"= {r.tokens * r.top_k}")
    over = [e for e, (a, k) in enumerate(zip(r.assigned, r.kept)) if k > a]
    if over or len(r.kept) != len(r.assigned):
        out.append(f"rank {r.rank}: kept more than assigned at experts {over}" if over
                   else f"rank {r.rank}: {len(r.kept)} kept counts for {len(r.assigned)} experts")
    return out


def _same(rows: Sequence[RoutingStep], what: str, value_of: Callable[[RoutingStep], Any]) -> Any:
    """The one value of ``what`` all ranks of a (step, layer) share; ValueError naming them where they differ."""
    values = {r.rank: value_of(r) for r in rows}
    if len(set(values.values())) > 1:
        raise ValueError(f"RoutingStep of step {rows[0].step} layer {rows[0].layer!r}: ranks disagree on {what}: "
                         f"{values}")
    return next(iter(values.values()), None)


def routing_matrix(records: Sequence[Any], step: int | None = None, layer: str | None = None) -> dict[str, Any]:
    """Everything ExpertRouting and plot_routing draw for one (step, layer), JSON-only: ``rows`` (assignments,
    source rank x expert, in ``ranks`` order), ``ep_ranks`` (each row's), ``owner`` (each expert's ep rank),
    ``totals``/``kept``/``dropped_per_expert`` per expert, ``dropped``, ``imbalance`` (max/mean load), ``aux_loss``
    (mean over ranks; None when not recorded), ``tokens``, ``top_k``, ``ep``, ``local``/``remote`` (assignments staying on / leaving
    their rank), ``ok``, ``problems``, ``header`` (the check in words) and ``disagree_at`` ([step, layer] pairs
    of all the records where a row fails its check). ``step`` None: the last; ``layer`` None: the first."""
    checked = [RoutingStep.coerce(r) for r in records]
    pick = choose(checked, step, layer)
    rows = sorted(pick["rows"], key=lambda r: (r.ep_rank, r.rank))
    experts = _same(rows, "the number of experts", lambda r: len(r.assigned)) or 0
    ep = _same(rows, "ep", lambda r: r.ep) or 1
    top_k = _same(rows, "top_k", lambda r: r.top_k)
    if experts % ep:
        raise ValueError(f"{experts} experts cannot be split over ep={ep} ranks")
    owner = [e // (experts // ep) for e in range(experts)]
    totals = [sum(r.assigned[e] for r in rows) for e in range(experts)]
    kept = [sum(r.kept[e] for r in rows if e < len(r.kept)) for e in range(experts)]
    local = sum(n for r in rows for e, n in enumerate(r.assigned) if owner[e] == r.ep_rank)
    mean = sum(totals) / experts if experts else 0.0
    problems = [p for r in rows for p in row_problems(r)]
    twice = sorted({r.rank for r in rows if [x.rank for x in rows].count(r.rank) > 1})
    if twice:
        problems.append(f"ranks {twice} recorded more than once")
    tokens = sum(r.tokens for r in rows)
    return {"step": pick["step"], "layer": pick["layer"], "steps": pick["steps"], "layers": pick["layers"],
            "ranks": [r.rank for r in rows], "ep_ranks": [r.ep_rank for r in rows],
            "rows": [list(r.assigned) for r in rows], "experts": experts, "ep": ep, "owner": owner,
            "totals": totals, "kept": kept, "dropped_per_expert": [a - k for a, k in zip(totals, kept)],
            "dropped": sum(totals) - sum(kept), "mean": mean, "imbalance": max(totals) / mean if mean else None,
            "aux_loss": _mean_aux_loss(rows),
            "tokens": tokens, "top_k": top_k, "local": local, "remote": sum(totals) - local,
            "numbers": len(rows) * experts <= NUMBERS_UP_TO_CELLS, "ok": not problems, "problems": problems,
            "header": _header(rows, sum(totals), tokens, top_k, problems),
            "disagree_at": [list(p) for p in sorted({(r.step, r.layer) for r in checked if row_problems(r)})]}


def _mean_aux_loss(rows: Sequence[RoutingStep]) -> float | None:
    """The aux loss averaged over ranks; None when a rank did not record one (a Hugging Face MoE's router)."""
    known = [r.aux_loss for r in rows if r.aux_loss is not None]
    return sum(known) / len(rows) if rows and len(known) == len(rows) else None


def _header(rows: Sequence[RoutingStep], total: int, tokens: int, top_k: int | None, problems: list[str]) -> str:
    """The check in words: what was compared and whether it held."""
    if not rows:
        return "no routing records"
    said = f"total assignments {total} {'==' if total == tokens * top_k else '!='} tokens {tokens} × top_k {top_k}"
    return f"checked: {said}, every rank's row too" if not problems else f"MISMATCH: {said}; " + "; ".join(problems)


def summary(view: dict[str, Any]) -> str:
    """The load line under the bars: imbalance, drops, aux loss and what crosses the wire."""
    if not view["ranks"]:
        return ""
    imbalance = "n/a" if view["imbalance"] is None else f"{view['imbalance']:.2f}"
    crossing = view["remote"] / (view["local"] + view["remote"]) if view["local"] + view["remote"] else 0.0
    aux = "not recorded" if view["aux_loss"] is None else f"{view['aux_loss']:.4g}"
    return (f"load imbalance max/mean {imbalance} · dropped {view['dropped']} · aux loss (mean over ranks) "
            f"{aux} · {view['remote']} of {view['local'] + view['remote']} assignments "
            f"({crossing:.0%}) cross the wire")


def routing_view(records: Sequence[Any], step: int | None = None, layer: str | None = None) -> dict[str, Any]:
    """What ExpertRouting syncs: ``routing_matrix`` and its ``summary`` line."""
    view = routing_matrix(records, step, layer)
    return {**view, "summary": summary(view)}


class ExpertRouting(StepLayerView):
    """The all-to-all heatmap (``.cl-moe-cell[data-local]``), per-expert load bars (``.cl-moe-bar``), the check as
    a header (``.cl-moe-ok`` / ``.cl-moe-mismatch``) and step/layer selectors (``.cl-moe-step``, ``.cl-moe-layer``).
    ``ExpertRouting(records, step=None, layer=None)``; ``view`` holds ``routing_view(records, step, layer)``."""

    _esm = view_module("step_layer.js", "expert_routing.js")
    _css = _STATIC / "expert_routing.css"
    record_type = RoutingStep
    derive = staticmethod(routing_view)
    twin = staticmethod(lambda records, step, layer: plot_routing(records, step, layer))  # plot_routing comes below


def plot_routing(records: Sequence[Any], step: int | None = None, layer: str | None = None):
    """Static twin of ExpertRouting: the heatmap (patches gid ``cell:local`` / ``cell:remote``, counts gid ``count``
    where the matrix is small, ep-group separators gid ``separator``) over the per-expert load bars (gid ``kept``
    and ``dropped``, the mean dashed), the check as the figure's title, red on a mismatch."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    view = routing_matrix(records, step, layer)
    n, experts = len(view["ranks"]), view["experts"]
    fig = Figure(figsize=(max(7.0, 0.5 * experts + 2.5), 0.4 * n + 4.4), layout="constrained")
    heat, bars = fig.subplots(2, 1, sharex=True, height_ratios=[max(1.5, 0.4 * n + 0.6), 2.2])
    peak = max((v for row in view["rows"] for v in row), default=0) or 1
    for i, row in enumerate(view["rows"]):
        for e, v in enumerate(row):
            stays = view["owner"][e] == view["ep_ranks"][i]
            heat.add_patch(Rectangle((e - 0.5, i - 0.5), 1, 1, facecolor=LOCAL if stays else REMOTE,
                                     alpha=min(1.0, 0.08 + 0.92 * v / peak), edgecolor="white",
                                     gid="cell:local" if stays else "cell:remote"))
            if view["numbers"]:
                heat.text(e, i, str(v), ha="center", va="center", fontsize=7, gid="count",
                          color="white" if v / peak > 0.55 else "black")
    for e in range(1, experts):
        if view["owner"][e] != view["owner"][e - 1]:
            heat.axvline(e - 0.5, color="black", linewidth=1.2, gid="separator")
    for i in range(1, n):
        if view["ep_ranks"][i] != view["ep_ranks"][i - 1]:
            heat.axhline(i - 0.5, color="black", linewidth=1.2, gid="separator")
    for k in range(view["ep"]):
        held = [e for e in range(experts) if view["owner"][e] == k]
        heat.text(sum(held) / len(held), 1.01, f"experts on ep rank {k}", ha="center", va="bottom", fontsize=7,
                  transform=heat.get_xaxis_transform())
    heat.set_ylim(n - 0.5, -0.5)
    heat.set_yticks(range(n), [f"rank {r} (ep {k})" for r, k in zip(view["ranks"], view["ep_ranks"])], fontsize=7)
    heat.set_ylabel("source rank", fontsize=7)
    heat.set_title("green: stays on the sender's ep rank · blue: crosses the wire (all-to-all)", fontsize=7, pad=16)
    x = range(experts)
    bars.bar(x, view["kept"], color=REMOTE, gid="kept", label="kept")
    bars.bar(x, view["dropped_per_expert"], bottom=view["kept"], color=DROPPED, hatch="//", gid="dropped",
             label="dropped (over capacity)")
    if experts:
        bars.axhline(view["mean"], color="black", linestyle="--", linewidth=0.8, label="mean load")
    bars.set_xlim(-0.5, max(experts, 1) - 0.5)
    bars.set_xticks(list(x), [f"e{e}" for e in x], fontsize=7)
    bars.set_xlabel("expert", fontsize=7)
    bars.set_ylabel("assignments", fontsize=7)
    bars.set_title("\n".join(summary(view).rsplit(" · ", 1)), fontsize=7)
    bars.legend(fontsize=6, loc="upper right", frameon=False)
    elsewhere = [f"step {s} {name}" for s, name in view["disagree_at"] if [s, name] != [view["step"], view["layer"]]]
    title = f"step {view['step']} · {view['layer']} · ep={view['ep']} · top_k={view['top_k']}\n{view['header']}"
    fig.suptitle(title + (f"\nalso failing: {', '.join(elsewhere)}" if elsewhere else ""), fontsize=8,
                 color="black" if view["ok"] and not elsewhere else DROPPED)
    return fig
