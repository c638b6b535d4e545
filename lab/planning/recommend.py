"""Rank parallel layouts for a model on a cluster, the way the sizing guides (docs/design.md#sources) size them.

The procedure (the Turing Inc. guide, "Guidelines for choosing a configuration";
Fujii's distributed-training talk, "Tips for searching configurations";
Hugging Face's multi-GPU guide, "Scalability Strategy"):

1. every candidate must fit the GPU's memory;
2. TP stays inside a node and at most 8 (a divisor of the node's GPU count that
   divides the heads);
3. every candidate trains one global batch, 4 sequences per GPU unless one is given: M = 4·tp·pp·cp
   micro-batches of one sequence, at least the Turing Inc. guide's M >= 4P, so a deeper pipeline pays its
   bubble at the same batch as a shallower one;
4. the candidates that fit rank by their estimated time per trained sequence (``Plan.step``,
   ``lab.planning.plan_time``): compute, pipeline bubble, and the α–β time of every call on each link, the one
   between nodes at ``inter_bw``. This is the guides' step 4, "verify the bandwidth", made part of the choice:
   on a fast link DP grows as far as memory allows ("first grow DP as far as it goes"), on a slow one the
   layout that keeps DP inside a node and sends only PP's activations between nodes wins (Hugging Face's
   "DP+PP+TP+ZeRO-1" for slow inter-node links; Fujii: the best configuration changes with the inter-node
   network). Times within 10 % are a tie (``plan_ranking.TIME_TOLERANCE``), which the most DP, then the fewest
   stages, win. The best layout still warns [verify-bandwidth] when its traffic between nodes outlasts its
   compute.

A model with experts is also tried at every expert-parallel size ``ep`` that divides both DP and the
experts (EP lives inside DP, so it costs no DP: it trades the experts' memory, 1/ep, for all-to-alls).
Context parallelism is tried only when asked (``cp=``), or when nothing fits even with activation
checkpointing while the model states alone would: then it is activations of long sequences that do
not fit, and CP divides them by cp (it shards no model state: dp·cp ranks share the data axis
that dp alone would have). Checkpointing comes first because it needs no ranks (Fujii's talk).

FSDP's hybrid strategy shards inside a node and replicates across nodes (its
``dp_replicate`` is chosen so). The dp axis is sharded as ``zero`` says, ZeRO-1 by default: it is the sharding under
which the Turing Inc. guide's TP rule "TP ≥ (Parameters + Gradients) / (GPU_memory − Activations)"
holds (parameters and gradients whole per replica, optimizer states sharded), and the
one that Hugging Face's multi-GPU guide pairs with PP. With ``zero=3`` nearly every model fits as
pure FSDP; its all-gathers per micro-batch then count in each candidate's step time.
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
from lab.planning.plan_ranking import best_warnings, rank_key, reason


SEQUENCES_PER_GPU = 4  # the default global batch per GPU: M = 4·tp·pp·cp >= 4P for every candidate


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
        return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "zero": lay.zero,
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


def _microbatches(dp: int, global_batch: int, micro_batch: int | None, microbatches: int | None) -> int | None:
    """M for a candidate: given, or from the global batch (None when it does not split into whole micro-batches)."""
    if microbatches is not None:
        return microbatches
    per = dp * (micro_batch or 1)
    return global_batch // per if global_batch % per == 0 and global_batch >= per else None


def recommend(model: str | float | ModelSpec | Mapping[str, Any], gpus: int, gpus_per_node: int = 8,
              gpu_mem_gb: float = 80.0, *, dp: int | None = None, zero: int = 1,
              fsdp_strategy: str | None = None, max_tp: int = 8, top_k: int = 5,
              global_batch: int | None = None, micro_batch: int | None = None,
              microbatches: int | None = None, activation_checkpointing: bool | None = None,
              ep: int | None = None, cp: int | None = None, **plan_kwargs: Any) -> Recommendation:
    """Ranked candidate layouts, best first, each with its reason.

    ``dp`` fixes the data-parallel size, as the Turing Inc. guide's formula
    "PP_stages = ceil(Total_GPUs / (TP_size × DP_size))" takes it as given (their
    1024-GPU 405B example keeps DP=8). ``zero``/``fsdp_strategy`` shard the dp axis.
    Without a global batch (or ``microbatches``), every candidate trains the same 4·gpus sequences of
    ``micro_batch`` (1): M = 4·tp·pp·cp, at least the Turing Inc. guide's M ≥ 4P, and step times compare at one
    batch. ``activation_checkpointing=None`` tries without it first and turns it on only when nothing fits
    (Fujii's distributed-training talk: "turn on activation checkpointing and check whether TP and PP can be
    reduced"). ``ep`` fixes the expert-parallel
    size (None: every divisor of DP and of the experts, for a model with experts); ``cp`` the context-parallel
    size (None: 1, or the sizes that cut the sequence into 2·cp chunks when only activations keep a layout
    from fitting; module docstring). Other keywords (seq_len, dtype, optimizer, schedule, intra_bw, inter_bw,
    intra_alpha_us, inter_alpha_us, gpu_tflops, mfu, target_iter_s, activations_gb) go to ``plan_layout()``:
    the links and the GPU's speed set the estimated step time the ranking uses. When nothing fits, the smallest
    layouts are returned with a warning.
    """
    spec = get_model(model)
    if global_batch is None and microbatches is None:  # one batch for all, so that their step times compare
        global_batch = SEQUENCES_PER_GPU * gpus * (micro_batch or 1)
    search = dict(dp=dp, zero=zero, fsdp_strategy=fsdp_strategy, max_tp=max_tp, global_batch=global_batch,
                  micro_batch=micro_batch, microbatches=microbatches, ep=ep)
    checkpointing = [False, True] if activation_checkpointing is None else [bool(activation_checkpointing)]
    tried: list[tuple[list[Plan], list[str]]] = []
    for sizes in [[cp]] if cp is not None else [[1], None]:  # None: the cp sizes, if only activations block
        if sizes is None:
            if not _activations_block(tried[-1][0], gpu_mem_gb):
                break
            sizes = _cp_choices(spec, gpus, plan_kwargs.get("seq_len"))
        for ac in checkpointing:
            plans = _candidates(spec, gpus, gpus_per_node, gpu_mem_gb, ac, sizes, search, plan_kwargs)
            tried.append((plans, _pass_notes(ac and activation_checkpointing is None, sizes != [1] and cp is None)))
            if any(p.fits for p in plans):
                return _rank(plans, top_k, gpu_mem_gb, fsdp_strategy, dp, tried[-1][1])
    plans, notes = min(tried, key=lambda t: min((p.memory.total for p in t[0]), default=float("inf")))
    return _rank(plans, top_k, gpu_mem_gb, fsdp_strategy, dp, notes)


def _pass_notes(checkpointing: bool, context: bool) -> list[str]:
    """Why a search pass had to turn on what it did."""
    return ((["nothing fits without activation checkpointing, so these layouts use it"] if checkpointing else [])
            + (["nothing fits with whole sequences, so these layouts split each one over cp ranks (context "
                "parallelism)"] if context else []))


def _activations_block(plans: list[Plan], gpu_mem_gb: float) -> bool:
    """Whether a layout's model states fit the GPU but its activations do not: what context parallelism cures."""
    return bool(plans) and any(p.memory.total - p.memory.activations <= gpu_mem_gb * GB for p in plans)


def _cp_choices(spec: ModelSpec, gpus: int, seq_len: int | None) -> list[int]:
    """Context-parallel sizes above 1 that divide the GPUs and cut the sequence into 2·cp whole chunks."""
    seq = seq_len or spec.seq_len
    return [c for c in divisors(gpus) if c > 1 and seq % (2 * c) == 0] if spec.has_shape else []


def _ep_choices(spec: ModelSpec, dp: int, fixed: int | None) -> list[int]:
    """Expert-parallel sizes for a candidate's dp: the one asked for, or every divisor of dp and of the experts."""
    if fixed is not None:
        return [fixed] if dp % fixed == 0 else []
    return [e for e in divisors(dp) if spec.experts % e == 0] if spec.experts else [1]


def _candidates(spec: ModelSpec, gpus: int, gpus_per_node: int, gpu_mem_gb: float, ac: bool, cp_sizes: list[int],
                search: dict[str, Any], plan_kwargs: dict[str, Any]) -> list[Plan]:
    """A plan for every (tp, cp, pp, dp, ep) the rules allow."""
    plans = []
    for tp in tp_choices(spec, gpus, gpus_per_node, search["max_tp"]):
        for cp in (c for c in cp_sizes if (gpus // tp) % c == 0):
            for pp in divisors(gpus // (tp * cp)):
                cand_dp = gpus // (tp * cp * pp)
                if (search["dp"] is not None and cand_dp != search["dp"]) or \
                        (spec.layers is not None and pp > spec.layers):
                    continue
                for ep in _ep_choices(spec, cand_dp, search["ep"]):
                    plans += _plan_or_none(spec, gpus, gpus_per_node, gpu_mem_gb, ac,
                                           {"dp": cand_dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}, search, plan_kwargs)
    return plans


def _plan_or_none(spec: ModelSpec, gpus: int, gpus_per_node: int, gpu_mem_gb: float, ac: bool, sizes: dict[str, int],
                  search: dict[str, Any], plan_kwargs: dict[str, Any]) -> list[Plan]:
    """[the plan of one candidate], or [] when its batch does not split or the model refuses it."""
    cand_dp, fsdp_strategy = sizes["dp"], search["fsdp_strategy"]
    m = _microbatches(cand_dp, search["global_batch"], search["micro_batch"], search["microbatches"])
    if m is None or m < sizes["pp"]:
        return []  # no whole micro-batches, or fewer than 1F1B needs
    data = cand_dp * sizes["cp"]  # the ranks ZeRO shards over
    par = {**sizes, "microbatches": m, "zero": 0 if (data == 1 or fsdp_strategy) else search["zero"],
           "fsdp_strategy": fsdp_strategy if data > 1 else None}
    if par["fsdp_strategy"] == "hybrid":
        par["dp_replicate"] = data // node_shard(data, sizes["tp"], gpus_per_node)
    try:
        return [plan_layout(spec, gpus, gpus_per_node, gpu_mem_gb, parallel=par, global_batch=search["global_batch"],
                            micro_batch=search["micro_batch"], activation_checkpointing=ac, **plan_kwargs)]
    except ValueError:
        return []


def _rank(plans: list[Plan], top_k: int, gpu_mem_gb: float, fsdp_strategy: str | None,
          fixed_dp: int | None, notes: list[str]) -> Recommendation:
    warnings = list(notes)
    least_s = min((p.step.per_sequence_s for p in plans if p.fits), default=None)
    fitting = sorted((p for p in plans if p.fits), key=lambda p: rank_key(p, least_s))
    if not plans:
        return Recommendation((), ("no layout could be formed: check gpus, gpus_per_node, the heads "
                                   "and the batch (M must be a whole number >= P)",))
    if not fitting:
        chosen = sorted(plans, key=lambda p: p.memory.total)[:top_k]
        warnings.append(f"no layout fits in {gpu_mem_gb:g} GB per GPU; the smallest needs "
                        f"{chosen[0].memory.total / GB:.1f} GB. Try "
                        + ("" if chosen[0].layout.activation_checkpointing else "activation_checkpointing=True, ")
                        + "a smaller micro_batch or seq_len, a higher zero stage, or more GPUs")
    else:
        chosen = fitting[:top_k]
        warnings += best_warnings(chosen[0], fsdp_strategy)
    max_dp = max((p.layout.dp for p in fitting), default=0)
    cands = tuple(Candidate(p, reason(p, max_dp, fixed_dp, least_s)) for p in chosen)
    return Recommendation(cands, tuple(warnings))
