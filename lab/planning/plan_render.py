"""Text and HTML views of a Plan and of recommend()'s candidates (pure functions of them).

GB here is 1e9 bytes, as in the sizing guides (docs/design.md#sources). Pure Python; no torch.
"""
from __future__ import annotations

import html as _html
from typing import Any, Callable

from kernels.contract.layout_combinations import SPLIT_BACKWARD_SCHEDULES
from lab.planning.plan_math import GB, gbps


class Rendered:
    """Prints as ``render_text(self)`` (both str and repr) and shows in Jupyter as ``render_html(self)``.

    Subclasses set the two to this module's functions; a dataclass subclass needs
    ``repr=False``, or its generated ``__repr__`` would hide the text view.
    """

    render_text: Callable[[Any], str]
    render_html: Callable[[Any], str]

    def __str__(self) -> str:
        return self.render_text()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return self.render_html()


def _gb(x: float) -> str:
    return f"{x / GB:,.1f} GB"


def memory_rows(p: Any) -> list[tuple[str, str]]:
    """(label, value) rows of the per-GPU memory table."""
    m = p.memory
    verdict = "yes" if m.fits else "NO"
    split = f"over ep={p.layout.ep}, not by ZeRO" if p.layout.ep > 1 else "sharded with the rest"
    experts = [("  experts", f"{_gb(m.experts)} of the three above: the routed experts, {split}")] \
        if m.experts else []
    return [("parameters", _gb(m.params)), ("gradients", _gb(m.grads)), ("optimizer", _gb(m.optimizer)),
            *experts, ("activations", _gb(m.activations)), ("total", _gb(m.total)),
            ("fits", f"{verdict} ({m.capacity / GB:.0f} GB per GPU)")]


def comm_rows(p: Any) -> list[tuple[str, ...]]:
    """Rows of the communication table: axis, op, phase, link, group, calls, payload, wire."""
    return [(e.axis, e.op, e.phase, e.link, str(e.group_size), str(e.count), _gb(e.total_payload),
             _gb(e.wire_bytes)) for e in p.comm]


def link_rows(p: Any) -> list[tuple[str, ...]]:
    """Rows per link: wire bytes, bandwidth, latency per ring step, time (latency included) and
    the bandwidth needed for the target."""
    return [(load.link, _gb(load.wire_bytes), f"{load.bandwidth_gbps:,.0f} GB/s", f"{load.alpha_us:g} us",
             f"{load.time_s:.3f} s ({load.latency_s:.3f} s latency)",
             f"{load.needed_gbps:,.1f} GB/s ({gbps(load.needed_gbps):,.0f} Gbps)")
            for load in p.links]


def step_line(p: Any) -> str:
    """The estimated iteration (``Plan.step``): its total and what it is spent on, nothing overlapped."""
    t = p.step
    return (f"estimated step (nothing overlapped): {t.total_s:.3f} s = compute {t.compute_s:.3f} + bubble "
            f"{t.bubble_s:.3f} + inside nodes {t.intra_s:.3f} + between nodes {t.inter_s:.3f} s, for "
            f"{t.sequences} sequences ({t.gpu_tflops:g} TFLOP/s per GPU at MFU {t.mfu:g})")


def _title(p: Any) -> str:
    head = (f"{p.model} ({p.params / 1e9:g}B params) on {p.gpus} GPUs ({p.gpus_per_node}/node, "
            f"{p.gpu_mem_gb:g} GB): {p.layout.describe()}")
    cp = f" ({p.seq_len // p.layout.cp} tokens per cp rank)" if p.layout.cp > 1 else ""
    batch = (f"global batch {p.global_batch} = dp {p.layout.dp} × micro-batch {p.micro_batch} × "
             f"M {p.microbatches}, seq {p.seq_len}{cp}, {p.dtype}, {p.optimizer}")
    return head + "\n" + batch


def _bubble(p: Any) -> str:
    if p.layout.pp == 1:
        return "bubble: none (no pipeline)"
    if p.bubble is None:
        return f"bubble ({p.layout.schedule}): no closed form; compare with 1f1b's"
    if p.layout.schedule in SPLIT_BACKWARD_SCHEDULES:  # the zero-bubble family: Qi et al. (2024)'s assumption
        form = "(p-1)/(3·v·m)" if p.layout.schedule == "interleaved_zero_bubble" else "ZB-V: 0"
        return (f"bubble ({p.layout.schedule}): {p.bubble:.1%} of the step; bubble/ideal {form} = "
                f"{p.bubble_megatron:.1%} if T_F = T_B = T_W (Qi et al., 2024)")
    return (f"bubble ({p.layout.schedule}): {p.bubble:.1%} of the step; "
            f"Megatron's bubble/ideal (p-1)/(v·m): {p.bubble_megatron:.1%}")


_CHECK_HEADER = ("measured beside predicted", "predicted", "measured", "ratio", "note")


def _text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header)] + [fmt.format(*row) for row in rows]


def text(p: Any) -> str:
    """A plain-text report of a Plan."""
    lines = [_title(p), "", "memory per GPU (busiest rank):"]
    lines += [f"  {k:<12} {v}" for k, v in memory_rows(p)]
    if p.comm:
        lines += ["", f"communication per iteration and rank (target {p.target_iter_s:g} s):"]
        header = ("axis", "op", "phase", "link", "n", "calls", "payload", "wire")
        lines += ["  " + row for row in _text_table(header, comm_rows(p))]
        lines += ["  " + row for row in
                  _text_table(("link", "wire", "bandwidth", "α/step", "time", "needed"), link_rows(p))]
    lines += ["", _bubble(p)] + ([step_line(p)] if p.step is not None else [])
    if p.measured is not None:
        lines += ["", p.measured.title() + ":"]
        lines += ["  " + row for row in _text_table(_CHECK_HEADER, p.measured.table_rows())]
    lines += [f"warning: {w}" for w in p.warnings] + [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]], cls: str) -> str:
    esc = _html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def html(p: Any) -> str:
    """An HTML report of a Plan: title, memory table, traffic tables, bubble, warnings."""
    esc = _html.escape
    parts = [f'<div class="lab-plan"><pre>{esc(_title(p))}</pre>',
             _html_table(("memory per GPU", "bytes"), memory_rows(p), "lab-plan-memory")]
    if p.comm:
        parts.append(_html_table(("axis", "op", "phase", "link", "n", "calls", "payload", "wire"),
                                 comm_rows(p), "lab-plan-comm"))
        parts.append(_html_table(("link", "wire", "bandwidth", "α/step", "time", "needed"), link_rows(p),
                                 "lab-plan-links"))
    parts.append(f"<p>{esc(_bubble(p))}</p>")
    if p.step is not None:
        parts.append(f"<p>{esc(step_line(p))}</p>")
    if p.measured is not None:
        parts.append(f"<p>{esc(p.measured.title())}</p>")
        parts.append(_html_table(_CHECK_HEADER, p.measured.table_rows(), "lab-plan-measured"))
    items = [f"<li>warning: {esc(w)}</li>" for w in p.warnings] + [f"<li>note: {esc(n)}</li>" for n in p.notes]
    if items:
        parts.append(f'<ul class="lab-plan-warnings">{"".join(items)}</ul>')
    return "".join(parts) + "</div>"


def candidate_rows(rec: Any) -> list[tuple[str, ...]]:
    """Rows of recommend()'s ranking: rank, layout, memory, fits, bubble, estimated step time, reason."""
    rows = []
    for i, c in enumerate(rec.candidates, 1):
        bubble = "-" if c.plan.bubble is None else f"{c.plan.bubble:.1%}"
        step = f"{c.plan.step.total_s:,.2f} s / {c.plan.step.sequences}"
        rows.append((str(i), c.plan.layout.describe(), _gb(c.plan.memory.total),
                     "yes" if c.plan.fits else "NO", bubble, step, c.reason))
    return rows


_CANDIDATE_HEADER = ("#", "layout", "memory/GPU", "fits", "bubble", "step (est.) / seqs", "why")


def recommendation_text(rec: Any) -> str:
    """Plain-text ranking of candidates, with the recommendation's warnings."""
    lines = _text_table(_CANDIDATE_HEADER, candidate_rows(rec))
    return "\n".join(lines + [f"warning: {w}" for w in rec.warnings])


def recommendation_html(rec: Any) -> str:
    """HTML ranking of candidates, with the recommendation's warnings."""
    out = _html_table(_CANDIDATE_HEADER, candidate_rows(rec), "lab-recommend")
    items = "".join(f"<li>warning: {_html.escape(w)}</li>" for w in rec.warnings)
    return f'<div class="lab-recommend">{out}{f"<ul>{items}</ul>" if items else ""}</div>'
