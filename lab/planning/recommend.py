"""Rank parallel layouts for a model on a cluster, the way the sizing guides (docs/design.md#sources) size them.

The procedure (the Turing Inc. guide, "Guidelines for choosing a configuration";
Fujii's distributed-training talk, "Tips for searching configurations";
Hugging Face's multi-GPU guide, "Scalability Strategy"):

1. every candidate must fit the GPU's memory;
2. TP stays inside a node and at most 8 (a divisor of the node's GPU count that
   divides the heads);
3. DP grows as far as memory allows ("first grow DP as far as it goes");
4. PP is added only when needed, with M >= 4P micro-batches per iteration;
   among equal DP, fewer stages (less bubble) rank first, so TP is preferred to PP.

FSDP's hybrid strategy shards inside a node and replicates across nodes (its
``dp_replicate`` is chosen so). The dp axis is sharded as ``zero`` says, ZeRO-1 by default: it is the sharding under
which the Turing Inc. guide's TP rule "TP ≥ (Parameters + Gradients) / (GPU_memory − Activations)"
holds (parameters and gradients whole per replica, optimizer states sharded), and the
one that Hugging Face's multi-GPU guide pairs with PP. With ``zero=3`` nearly every model fits as
pure FSDP, so the ranking then returns FSDP over every GPU, which the sizing guides avoid for traffic reasons.
Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from lab.planning import plan_render
from lab.planning.plan_layout import Plan, plan_layout
from lab.planning.plan_math import GB
from lab.planning.plan_mesh import Layout
from lab.planning.plan_models import ModelSpec, get_model


@dataclass(frozen=True)
class Candidate:
    """One ranked layout: the plan behind it and why it ranks where it does."""

    plan: Plan
    reason: str

    @property
    def layout(self) -> Layout:
        """The layout of the plan."""
        return self.plan.layout

    @property
    def parallel(self) -> dict[str, Any]:
        """Fields for ``plan(parallel=...)`` or ``lab.Parallel(**...)``."""
        lay = self.plan.layout
        return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero": lay.zero,
                "fsdp_strategy": lay.fsdp_strategy, "schedule": lay.schedule,
                "microbatches": self.plan.microbatches,
                "dp_replicate": lay.dp_replicate if lay.fsdp_strategy == "hybrid" else None}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {"parallel": self.parallel, "reason": self.reason, "plan": self.plan.to_dict()}


@dataclass(frozen=True, repr=False)
class Recommendation(plan_render.Rendered):
    """Candidates, best first, and warnings about the search as a whole."""

    candidates: tuple[Candidate, ...]
    warnings: tuple[str, ...] = ()

    @property
    def best(self) -> Candidate:
        """The top candidate (which may not fit: see ``warnings``)."""
        if not self.candidates:
            raise ValueError("no candidate layout: " + "; ".join(self.warnings))
        return self.candidates[0]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, i: int) -> Candidate:
        return self.candidates[i]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {"candidates": [c.to_dict() for c in self.candidates], "warnings": list(self.warnings)}

    render_text = plan_render.recommendation_text
    render_html = plan_render.recommendation_html


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(spec: ModelSpec, gpus: int, gpus_per_node: int, max_tp: int = 8) -> list[int]:
    """TP sizes that keep TP inside a node: divisors of gpus_per_node, ≤ max_tp, dividing
    the head count and the GPU count."""
    return [t for t in divisors(gpus_per_node)
            if t <= max_tp and gpus % t == 0 and (spec.heads is None or spec.heads % t == 0)]


def node_shard(dp: int, tp: int, gpus_per_node: int) -> int:
    """The HSDP shard size that keeps a shard group inside a node (shard within nodes,
    replicate across them): the largest divisor of dp that fits beside tp on one node."""
    per_node = max(1, gpus_per_node // tp)
    return max(d for d in divisors(dp) if d <= per_node)


def _microbatches(pp: int, dp: int, global_batch: int | None, micro_batch: int | None,
                  microbatches: int | None) -> int | None:
    """M for a candidate: given, or from the global batch, or 4P (the Turing Inc. guide: M ≥ 4 × P)."""
    if microbatches is not None:
        return microbatches
    if global_batch is not None:
        per = dp * (micro_batch or 1)
        return global_batch // per if global_batch % per == 0 and global_batch >= per else None
    return 4 * pp if pp > 1 else 1


def _key(p: Plan) -> tuple[int, int, int]:
    """Rank: M ≥ 4P first, then most DP, then fewest stages (hence the most TP)."""
    lay = p.layout
    short = lay.pp > 1 and p.microbatches < 4 * lay.pp
    return (int(short), -lay.dp, lay.pp)


def _reason(p: Plan, max_dp: int, fixed_dp: int | None) -> str:
    lay, mem = p.layout, p.memory
    parts = [f"{'fits' if p.fits else 'does NOT fit'}: {mem.total / GB:.1f} of {mem.capacity / GB:.0f} GB"
             + (" with activation checkpointing" if lay.activation_checkpointing else "")]
    parts.append(f"TP{lay.tp} inside a node" if lay.tp > 1 else "no TP")
    most = " (the most data parallelism that fits)" if lay.dp == max_dp and p.fits else ""
    parts.append(f"DP{lay.dp}{most}, ZeRO-{lay.zero}" if not lay.fsdp_strategy
                 else f"DP{lay.dp}{most}, FSDP {lay.fsdp_strategy}")
    if lay.pp > 1:
        ok = ">=" if p.microbatches >= 4 * lay.pp else "<"
        why = ""
        if fixed_dp:
            why = f" = gpus/(TP·DP) with DP fixed at {fixed_dp}"
        elif most:
            why = " to fit memory"
        bubble = f"bubble {p.bubble:.1%}" if p.bubble is not None else f"{lay.schedule} bubble: no closed form"
        parts.append(f"PP{lay.pp}{why}, M={p.microbatches} {ok} 4P, {bubble}")
    else:
        parts.append("no PP needed")
    inter = p.link("inter")
    if inter.wire_bytes:
        parts.append(f"{inter.wire_bytes / GB:.1f} GB/iter between nodes ({inter.time_s:.2f} s)")
    return "; ".join(parts)


def recommend(model: str | float | ModelSpec | Mapping[str, Any], gpus: int, gpus_per_node: int = 8,
              gpu_mem_gb: float = 80.0, *, dp: int | None = None, zero: int = 1,
              fsdp_strategy: str | None = None, max_tp: int = 8, top_k: int = 5,
              global_batch: int | None = None, micro_batch: int | None = None,
              microbatches: int | None = None, activation_checkpointing: bool | None = None,
              **plan_kwargs: Any) -> Recommendation:
    """Ranked candidate layouts, best first, each with its reason.

    ``dp`` fixes the data-parallel size, as the Turing Inc. guide's formula
    "PP_stages = ceil(Total_GPUs / (TP_size × DP_size))" takes it as given (their
    1024-GPU 405B example keeps DP=8). ``zero``/``fsdp_strategy`` shard the dp axis.
    Without a global batch, M = 4P. ``activation_checkpointing=None`` tries without it
    first and turns it on only when nothing fits (Fujii's distributed-training talk: "turn on
    activation checkpointing and check whether TP and PP can be reduced"). Other keywords (seq_len,
    dtype, optimizer, schedule, intra_bw, inter_bw, target_iter_s, activations_gb) go to ``plan_layout()``. When
    nothing fits, the smallest layouts are returned with a warning.
    """
    spec = get_model(model)
    search = dict(dp=dp, zero=zero, fsdp_strategy=fsdp_strategy, max_tp=max_tp,
                  global_batch=global_batch, micro_batch=micro_batch, microbatches=microbatches)
    plans = _candidates(spec, gpus, gpus_per_node, gpu_mem_gb, bool(activation_checkpointing),
                        search, plan_kwargs)
    notes = []
    if activation_checkpointing is None and plans and not any(p.fits for p in plans):
        retry = _candidates(spec, gpus, gpus_per_node, gpu_mem_gb, True, search, plan_kwargs)
        if retry and min(p.memory.total for p in retry) < min(p.memory.total for p in plans):
            plans = retry
            notes.append("nothing fits without activation checkpointing, so these layouts use it")
    return _rank(plans, top_k, gpu_mem_gb, fsdp_strategy, dp, notes)


def _candidates(spec: ModelSpec, gpus: int, gpus_per_node: int, gpu_mem_gb: float, ac: bool,
                search: dict[str, Any], plan_kwargs: dict[str, Any]) -> list[Plan]:
    """A plan for every (tp, pp, dp) the rules allow."""
    dp, zero, fsdp_strategy = search["dp"], search["zero"], search["fsdp_strategy"]
    global_batch, micro_batch = search["global_batch"], search["micro_batch"]
    plans = []
    for tp in tp_choices(spec, gpus, gpus_per_node, search["max_tp"]):
        for pp in divisors(gpus // tp):
            cand_dp = gpus // (tp * pp)
            if (dp is not None and cand_dp != dp) or (spec.layers is not None and pp > spec.layers):
                continue
            m = _microbatches(pp, cand_dp, global_batch, micro_batch, search["microbatches"])
            if m is None or m < pp:
                continue  # no whole micro-batches, or fewer than 1F1B needs
            par = {"dp": cand_dp, "tp": tp, "pp": pp, "microbatches": m,
                   "zero": 0 if (cand_dp == 1 or fsdp_strategy) else zero,
                   "fsdp_strategy": fsdp_strategy if cand_dp > 1 else None}
            if par["fsdp_strategy"] == "hybrid":
                par["dp_replicate"] = cand_dp // node_shard(cand_dp, tp, gpus_per_node)
            try:
                plans.append(plan_layout(spec, gpus, gpus_per_node, gpu_mem_gb, parallel=par,
                                         global_batch=global_batch, micro_batch=micro_batch,
                                         activation_checkpointing=ac, **plan_kwargs))
            except ValueError:
                continue
    return plans


def _rank(plans: list[Plan], top_k: int, gpu_mem_gb: float, fsdp_strategy: str | None,
          fixed_dp: int | None, notes: list[str]) -> Recommendation:
    warnings = list(notes)
    fitting = sorted((p for p in plans if p.fits), key=_key)
    if not plans:
        return Recommendation((), ("no layout could be formed: check gpus, gpus_per_node, the heads "
                                   "and the batch (M must be a whole number >= P)",))
    if not fitting:
        chosen = sorted(plans, key=lambda p: (p.memory.total, _key(p)))[:top_k]
        warnings.append(f"no layout fits in {gpu_mem_gb:g} GB per GPU; the smallest needs "
                        f"{chosen[0].memory.total / GB:.1f} GB. Try "
                        + ("" if chosen[0].layout.activation_checkpointing else "activation_checkpointing=True, ")
                        + "a smaller micro_batch or seq_len, a higher zero stage, or more GPUs")
    else:
        chosen = fitting[:top_k]
        best = chosen[0]
        if best.layout.pp > 1 and best.microbatches < 4 * best.layout.pp:
            warnings.append(f"best layout has M={best.microbatches} < 4P={4 * best.layout.pp}: "
                            "raise the global batch for a smaller bubble")
        if best.layout.zero == 1 and best.layout.tp > 1 and not fsdp_strategy:
            warnings.append("ZeRO-1 with TP is Megatron's distributed optimizer; lab.Parallel runs "
                            "ZeRO-1 with ZeroRedundancyOptimizer, which refuses tp > 1: use zero=2 "
                            "there (it needs no more memory)")
    max_dp = max((p.layout.dp for p in fitting), default=0)
    cands = tuple(Candidate(p, _reason(p, max_dp, fixed_dp)) for p in chosen)
    return Recommendation(cands, tuple(warnings))

