"""Dry run on the driver: one rank's real shard of a large layout, beside the analytic plan.

``dry_run(parallel, "llama3-70b", rank=0, gpus=32)`` builds rank 0's shard of the
layout with the real torch machinery (DTensor TP, PP stage cut, FSDP2 on a (pp, dp, tp)
DeviceMesh) on the ``meta`` device under torch's fake process group, and reports the
bytes read from the local shard shapes next to ``lab.planning.planner.plan`` for the same layout.

The rank side (``kernels.measure.dry_run``) runs in a subprocess (``python -m kernels.measure.dry_run``,
JSON in and out): the fake process group is process-global, and the notebook kernel
must never hold one (it would shadow a real ``lab.start()`` world).

Measured vs computed: parameter bytes are measured (local shard numel × element size);
gradient and optimizer bytes are computed from the same local shard numel with the
dtype and optimizer rule (K bytes per parameter, ``lab.planning.plan_math.optimizer_bytes``),
since neither exists on meta.

Like with like: a preset's ``params`` is the round figure (70e9 for Llama-3 70B), and
``plan()`` sizes with it; the shards add up to the shape-derived count (70.55e9). So
the report shows the plan twice: with the nominal count (what ``lab.plan`` says) and
with ``spec.exact()``, which counts part by part as the ranks build them (norms whole on every
tp rank, the embeddings on the first stage, the head on the last): the shard equals it.
ZeRO-2/3 over several micro-batches adds the whole gradient FSDP2 holds until the step's
reduce-scatter (``DryRunReport.accumulating``), computed from the shard's whole shapes.
"""
from __future__ import annotations

import html as _html
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from lab.planning.plan_math import GB, dtype_bytes, optimizer_bytes
from lab.planning.plan_mesh import Layout, layout_from
from lab.planning.plan_models import ModelSpec, get_model
from lab.planning.planner import Plan, plan

_ROOT = Path(__file__).resolve().parents[2]  # the directory holding lab/ and kernels/
_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "gated_mlp",
               "tied_embeddings", "learned_pos", "bias")


@dataclass(frozen=True)
class DryRunReport:
    """One rank's measured model states beside the analytic plan (bytes; GB = 1e9)."""

    model: str
    layout: Layout
    rank: int
    coords: dict[str, int]  # this rank's index on each mesh axis
    dtype: str
    optimizer: str
    optimizer_k: float  # optimizer bytes per parameter used for the computed row
    shape_params: int  # the whole model's parameters counted on meta (shape-derived)
    nominal_params: float  # the preset's round figure, which plan() uses
    measured: dict[str, float]  # params, params_whole, grads, optimizer, local_numel[, params_padded]
    plan: Plan  # plan() with the nominal count
    plan_exact: Plan  # plan() with the shape-derived count (spec.exact())
    layers: tuple[int, int]  # this rank's blocks [first, last + 1)
    shards: tuple[dict[str, Any], ...]  # one row per parameter kind: global/local shape, placements
    wall_s: float  # driver wall time, subprocess included
    rank_wall_s: float  # inside the rank process: fake world, build, TP, FSDP
    notes: tuple[str, ...] = field(default=())

    @property
    def accumulating(self) -> bool:
        """ZeRO-2/3 over several micro-batches: FSDP2 holds a whole gradient until the step's one reduce-scatter
        (and a pipeline's ZeRO-3 whole parameters), which the plan counts and a dry run, taking no step, derives
        from the shard's whole (TP/PP-local) shapes."""
        return self.layout.zero >= 2 and self.plan.microbatches > 1

    @property
    def params_as_planned(self) -> float:
        """Measured parameter bytes in the plan's convention: ZeRO-3 counts the shard at
        rest; ZeRO-0/1/2 count whole (TP/PP-local) parameters, as held between forward and backward,
        and so does ZeRO-3 in a pipeline over several micro-batches."""
        whole = self.layout.zero != 3 or (self.accumulating and self.layout.pp > 1)
        return self.measured["params_whole" if whole else "params"]

    @property
    def grads_as_planned(self) -> float:
        """Gradient bytes in the plan's convention: the shard's, and while accumulating the whole gradient beside
        it, in float32 under bf16 (FSDP2's reduce dtype)."""
        elem = dtype_bytes(self.dtype)
        return self.measured["grads"] + (self.measured["params_whole"] / elem * max(elem, 4)
                                         if self.accumulating else 0.0)

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(category, measured, plan nominal, plan exact) for params, grads, optimizer, total."""
        m, p, e = self.measured, self.plan.memory, self.plan_exact.memory
        out = [("parameters", self.params_as_planned, p.params, e.params),
               ("gradients", self.grads_as_planned, p.grads, e.grads),
               ("optimizer", m["optimizer"], p.optimizer, e.optimizer)]
        out.append(("model states", sum(r[1] for r in out), sum(r[2] for r in out), sum(r[3] for r in out)))
        return out

    def ratio(self, category: str = "parameters", exact: bool = True) -> float:
        """measured / plan for one row ("parameters", "gradients", "optimizer", "model states")."""
        row = next(r for r in self.rows() if r[0] == category)
        return row[1] / (row[3] if exact else row[2])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (the plans as their own dicts)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("plan", "plan_exact", "layout")}
        out.update(layout=self.layout.__dict__, plan=self.plan.to_dict(), plan_exact=self.plan_exact.to_dict(),
                   rows=self.rows())
        return out

    def _title(self) -> str:
        c = self.coords
        return (f"dry run: {self.model} rank {self.rank} of {self.layout.world} ({self.layout.describe()}), "
                f"pp={c['pp']} dp={c['dp']} tp={c['tp']}, blocks {self.layers[0]}..{self.layers[1] - 1}; "
                f"{self.dtype}, {self.optimizer} (K={self.optimizer_k:g}); {self.wall_s:.1f} s")

    def _table(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        header = ("per GPU", "measured from shards", f"plan (Ψ={self.nominal_params / 1e9:g}B)",
                  f"plan (Ψ={self.shape_params / 1e9:.2f}B exact)", "measured / exact")
        rows = [(name, _gb(m), _gb(p), _gb(e), f"{m / e:.4f}" if e else "-") for name, m, p, e in self.rows()]
        return header, rows

    def _shard_rows(self) -> list[tuple[str, ...]]:
        return [(s["name"], str(s["count"]), str(s["global"]), str(s["local"]), " ".join(s["placements"]))
                for s in self.shards]

    def __repr__(self) -> str:
        header, rows = self._table()
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [self._title(), ""] + ["  " + fmt.format(*r) for r in [header, *rows]]
        lines += ["", "local shards:"] + [f"  {r[0]} ×{r[1]}: {r[2]} -> {r[3]} [{r[4]}]" for r in self._shard_rows()]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    __str__ = __repr__

    def _repr_html_(self) -> str:
        header, rows = self._table()
        notes = "".join(f"<li>{_html.escape(n)}</li>" for n in self.notes)
        return (f'<div class="lab-dry-run"><pre>{_html.escape(self._title())}</pre>'
                + _html_table(header, rows, "lab-dry-run-memory")
                + _html_table(("parameter", "count", "global", "local", "placements"), self._shard_rows(),
                              "lab-dry-run-shards")
                + (f"<ul>{notes}</ul>" if notes else "") + "</div>")


def _gb(x: float) -> str:
    return f"{x / GB:,.3f} GB"


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]], cls: str) -> str:
    esc = _html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def dry_run(plan_or_parallel: Plan | Any, model: str | ModelSpec | Mapping[str, Any] | None = None, *,
            rank: int = 0, gpus: int | None = None, dtype: str = "bf16", optimizer: str | float = "adam",
            gpus_per_node: int = 8, timeout: float = 600.0) -> DryRunReport:
    """Build rank ``rank``'s shard of a layout on meta under a fake process group, and size it.

    ``plan_or_parallel``: a ``Plan`` (its layout, gpus, gpus_per_node, dtype and optimizer
    are used; ``model`` defaults to its model name), a ``lab.Parallel``, or a dict
    (dp may be left out of a dict when ``gpus`` is given). ``model``: a preset name, a
    ModelSpec or a dict with a full shape (layers, hidden, heads, ffn, vocab).
    Returns a ``DryRunReport``; raises RuntimeError with the rank's stderr if it fails.
    """
    if isinstance(plan_or_parallel, Plan):
        p = plan_or_parallel
        lay, gpus, gpus_per_node, dtype, optimizer = p.layout, p.gpus, p.gpus_per_node, p.dtype, _opt(p.optimizer)
        model = model if model is not None else p.model
    else:
        lay = _layout(plan_or_parallel, gpus)
        gpus = gpus or lay.world
    spec = get_model(model)
    if spec.shape_params is None:
        raise ValueError(f"{spec.name} has no transformer shape (layers, hidden, ffn, vocab): nothing to build")
    if spec.experts or lay.ep > 1 or lay.cp > 1:  # kernels.measure.dry_run builds a dense model on (pp, dp, tp)
        raise ValueError("the dry run builds dense models on the (pp, dp, tp) mesh: no experts, ep or cp")
    if lay.world != gpus:
        raise ValueError(f"dp*tp*pp = {lay.dp}*{lay.tp}*{lay.pp} = {lay.world} must equal gpus={gpus}")
    k = optimizer_bytes(optimizer, dtype)
    cfg = _rank_config(spec, lay, rank, dtype, k)
    start = time.perf_counter()
    record = run_rank_subprocess(cfg, timeout)
    wall = time.perf_counter() - start
    kwargs = dict(gpus=gpus, gpus_per_node=gpus_per_node, parallel=lay, dtype=dtype, optimizer=optimizer)
    nominal, exact = plan(spec, **kwargs), plan(spec.exact(), **kwargs)
    return DryRunReport(spec.name, lay, rank, record["coords"], dtype, str(optimizer), k, record["model_params"],
                        spec.params, record["bytes"], nominal, exact, tuple(record["layers"]),
                        tuple(record["shards"]), wall, record["rank_wall_s"],
                        tuple(_notes(spec, lay, record, cfg, nominal.microbatches)))


def _opt(optimizer: str) -> str | float:
    """Plan.optimizer is str(optimizer): a number there is K itself."""
    try:
        return float(optimizer)
    except ValueError:
        return optimizer


def _layout(parallel: Any, gpus: int | None) -> Layout:
    if isinstance(parallel, Layout):
        return parallel
    if isinstance(parallel, Mapping) and "dp" not in parallel:
        if gpus is None:
            raise ValueError("a layout dict without dp needs gpus=... (dp = gpus / (tp*pp))")
        rest = int(parallel.get("tp", 1)) * int(parallel.get("pp", 1))
        if gpus % rest:
            raise ValueError(f"tp*pp = {rest} does not divide gpus={gpus}")
        parallel = {**parallel, "dp": gpus // rest}
    return layout_from(parallel)


def _rank_config(spec: ModelSpec, lay: Layout, rank: int, dtype: str, k: float) -> dict[str, Any]:
    """The JSON config kernels.measure.dry_run takes ("dp_replicate": HSDP's replicate degree, None without hybrid)."""
    hybrid = lay.fsdp_strategy == "hybrid"
    return {"model": {key: getattr(spec, key) for key in _MODEL_KEYS}, "dp": lay.dp, "tp": lay.tp,
            "pp": lay.pp, "zero": lay.zero, "rank": int(rank), "dtype": dtype, "optimizer_bytes_per_param": k,
            "dp_replicate": lay.dp_replicate if hybrid else None,
            # the dry run cuts one stage per pp rank, as GPipe/1F1B place them
            "stage_layers": list(lay.stage_layers) if lay.stage_layers and lay.stages_per_rank == 1 else None}


def run_rank_subprocess(cfg: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """Run ``python -m kernels.measure.dry_run`` with ``cfg`` on stdin; return its JSON record."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")  # nothing to compute on meta; do not crowd the CPU
    proc = subprocess.run([sys.executable, "-m", "kernels.measure.dry_run"], input=json.dumps(cfg), text=True,
                          capture_output=True, cwd=str(_ROOT), env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"dry run of rank {cfg.get('rank')} failed (exit {proc.returncode}):\n"
                           + proc.stderr[-4000:])
    return json.loads(lines[-1])


def _notes(spec: ModelSpec, lay: Layout, record: dict[str, Any], cfg: dict[str, Any], m: int) -> list[str]:
    out = [f"{spec.name}: plan() sizes with Ψ={spec.params / 1e9:g}B (the round figure); the shapes "
           f"built here add up to {record['model_params'] / 1e9:.3f}B (spec.exact())",
           "parameters: measured from local shard shapes on meta; gradients and optimizer states: "
           f"computed from the same shard numel (gradient = parameter dtype, optimizer K="
           f"{cfg['optimizer_bytes_per_param']:g} bytes/parameter)"]
    if record["coords"]["pp"] != 0:
        out.append("the plan's memory is its busiest pipeline rank's; this rank is on stage "
                   f"{record['coords']['pp']}")
    if lay.zero == 2 or (lay.zero == 3 and lay.pp > 1 and m > 1):
        out.append(f"ZeRO-{lay.zero}: parameters at rest are {_gb(record['bytes']['params'])} (sharded); the row "
                   "shows them whole, as held " + ("from forward to backward" if lay.zero == 2 else
                                                   "from the schedule's first backward to its last"))
    if lay.zero >= 2 and m > 1:
        out.append(f"gradients: the shard and, over M={m} micro-batches, the whole gradient FSDP2 holds until the "
                   "step's one reduce-scatter (computed from the whole shapes, in float32)")
    if lay.zero == 1:
        out.append("ZeRO-1: optimizer bytes are the rule numel·K/dp (ZeroRedundancyOptimizer is not built)")
    return out
