"""Analytic sizing of one given training layout: memory per GPU, traffic per link, bubble, warnings.

``plan_layout(model, gpus, ..., parallel=...)`` returns a frozen ``Plan`` for that layout; ``plan()``
and ``recommend()`` both size layouts with it, ``plan()`` picking one with ``recommend()`` when none is given.
The formulas live in ``lab.planning.plan_math`` and follow docs/design.md (#zero-formulas,
#communication-volume) and the FSDP, TP and PP sections of the Turing Inc. guide
(docs/design.md#sources): parameters, gradients and optimizer states shard by TP and PP, then by the
dp axis as ZeRO says; activations are the Turing Inc. guide's b·s·h·L·16 bytes per micro-batch,
times the micro-batches a schedule keeps in flight (GPipe M, 1F1B P), and are not split by TP unless
sequence parallelism is on (the Turing Inc. guide, TP memory estimate: "Activations are not
sharded"). GB is 1e9 bytes, as in the sizing guides.

Every pipeline rank is sized (``Plan.stages``, one ``StagePlan`` per pp rank, by
``lab.planning.plan_stages``); ``Plan.memory`` and the dp/tp part of ``Plan.comm`` are the
busiest rank's, and ``Plan.comm``'s p2p is a middle stage's (the busiest link). The
bubble is ``kernels.contract.layout_rules.bubble_theory``'s.

Expert parallelism (``ep``) and context parallelism (``cp``) follow docs/design.md#experts-and-context-parallelism:
world = pp·dp·cp·tp, ZeRO shards over dp·cp, the experts are split 1/ep outside ZeRO, every rank holds
s/cp tokens of each sequence; the MoE all-to-alls and the ring's sends are ``plan_comm``'s ep and cp entries.
Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kernels.contract.config_rules import moe_layout_problems
from kernels.contract.layout_combinations import (context_problems, cp_chunk_problems, expert_problems,
                                                  expert_split_problems)
from kernels.contract.layout_rules import bubble_theory, default_microbatches
from lab.planning import plan_render
from lab.planning.plan_check import PlanCheck
from lab.planning.plan_comm import all_entries
from lab.planning.plan_work import CommEntry, Work
from lab.planning.plan_latency import DEFAULT_ALPHA_US
from lab.planning.plan_math import GB, dtype_bytes, optimizer_bytes
from lab.planning.plan_mesh import Layout, axis_link, groups_link, hybrid_groups, layout_from
from lab.planning.plan_models import ModelSpec, get_model
from lab.planning.plan_moe import dispatched_tokens
from lab.planning.plan_stages import MemoryBreakdown, StagePlan, stage_plans
from lab.planning.stage_balance import StageBalance, plan_balance, plan_balance_notes
from lab.planning.plan_time import (DEFAULT_GPU_TFLOPS, DEFAULT_MFU, LinkLoad, StepTime, bandwidth_warnings,
                                    link_loads, step_time)


@dataclass(frozen=True, repr=False)
class Plan(plan_render.Rendered):
    """The analytic picture of one layout; ``to_dict()`` is JSON-able."""

    model: str
    params: float
    gpus: int
    gpus_per_node: int
    gpu_mem_gb: float
    layout: Layout
    global_batch: int
    micro_batch: int
    microbatches: int  # M, per iteration and dp rank
    seq_len: int
    dtype: str
    optimizer: str
    memory: MemoryBreakdown
    comm: tuple[CommEntry, ...]
    links: tuple[LinkLoad, ...]
    target_iter_s: float
    bubble: float | None  # (p-1)/(m+p-1) or (p-1)/(v·m+p-1); None without PP or a closed form
    bubble_megatron: float | None  # (p-1)/m or (p-1)/(v·m)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    stages: tuple[StagePlan, ...] = ()  # one per pipeline rank
    measured: PlanCheck | None = None  # lab.plan(..., measure_on=cluster): a scaled copy measured on the pool
    step: StepTime | None = None  # the estimated iteration: compute, bubble and each link (plan_time)
    stage_balance: StageBalance | None = None  # pp > 1: the stage_layers that balance stage compute (stage_balance)

    @property
    def fits(self) -> bool:
        """Whether the busiest rank's memory fits the GPU."""
        return self.memory.fits

    def comm_bytes(self, *, axis: str | None = None, op: str | None = None, phase: str | None = None,
                   link: str | None = None, wire: bool = True) -> float:
        """Sum of wire bytes (or payload bytes with ``wire=False``) over matching entries."""
        keep = [e for e in self.comm if (axis is None or e.axis == axis) and (op is None or e.op == op)
                and (phase is None or e.phase == phase) and (link is None or e.link == link)]
        return sum(e.wire_bytes if wire else e.total_payload for e in keep)

    def comm_by_op(self) -> dict[str, float]:
        """Wire bytes per collective type."""
        out: dict[str, float] = {}
        for e in self.comm:
            out[e.op] = out.get(e.op, 0.0) + e.wire_bytes
        return out

    def link(self, name: str) -> LinkLoad:
        """The LinkLoad for "intra" or "inter"."""
        return next(load for load in self.links if load.link == name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        out = dataclasses.asdict(self)
        out["memory"] = self.memory.to_dict()
        for stage, data in zip(self.stages, out["stages"]):
            data["memory"] = stage.memory.to_dict()
        out["fits"] = self.fits
        out["step"] = self.step.to_dict() if self.step is not None else None
        return out

    render_text = plan_render.text
    render_html = plan_render.html


def plan_layout(model: str | float | ModelSpec | Mapping[str, Any], gpus: int, gpus_per_node: int = 8,
                gpu_mem_gb: float = 80.0, intra_bw: float = 900.0, inter_bw: float = 400.0, *,
                parallel: Any, global_batch: int | None = None, micro_batch: int | None = None,
                seq_len: int | None = None, dtype: str = "bf16", optimizer: str | float = "adam",
                activation_checkpointing: bool | None = None, schedule: str | None = None,
                microbatches: int | None = None, target_iter_s: float = 1.0,
                activations_gb: float | None = None, intra_alpha_us: float = DEFAULT_ALPHA_US["intra"],
                inter_alpha_us: float = DEFAULT_ALPHA_US["inter"], ep: int | None = None,
                cp: int | None = None, gpu_tflops: float = DEFAULT_GPU_TFLOPS, mfu: float = DEFAULT_MFU) -> Plan:
    """Size the layout ``parallel`` analytically; the arguments are ``lab.planning.planner.plan``'s.

    ``parallel``: a ``lab.run.parallel.Parallel``, any object with its attributes, or a dict
    (dp may be left out of a dict: it is gpus / (tp·pp·cp)); ``ep``/``cp`` given here win over its own.
    Raises ValueError when dp·cp·tp·pp ≠ gpus, or when the model cannot take the layout (ep on a model
    without experts or E not divisible by ep, a sequence cp cannot cut into 2·cp chunks, sequence
    parallel with experts).
    """
    spec = get_model(model)
    lay = layout_from(_with_dp(parallel, gpus, cp), schedule=schedule,
                      activation_checkpointing=activation_checkpointing, ep=ep, cp=cp)
    if lay.world != gpus:
        raise ValueError(f"dp*cp*tp*pp = {lay.dp}*{lay.cp}*{lay.tp}*{lay.pp} = {lay.world} must equal gpus={gpus}")
    m_default = microbatches if microbatches is not None else _get_m(parallel)
    gb, mb, m = resolve_batch(lay, global_batch, micro_batch, m_default)
    seq = seq_len or spec.seq_len
    for _, message in _model_problems(spec, lay, seq):
        raise ValueError(message)
    base = _base_work(spec, lay, dtype, mb, m, seq)
    stages = stage_plans(spec, lay, base, gpus_per_node, optimizer_bytes(optimizer, dtype), gpu_mem_gb,
                         activations_gb)
    busiest = max(stages, key=lambda st: st.memory.total)  # the first on ties
    work = dataclasses.replace(base, psi_local=busiest.params - busiest.expert_params,
                               layers_on_rank=busiest.layers, expert_psi=busiest.expert_params,
                               moe_layers=busiest.moe_layers,
                               first_stage=0 in busiest.stage_ids, last_stage=lay.num_stages - 1 in busiest.stage_ids)
    mem, comm = busiest.memory, all_entries(lay, work, gpus_per_node)  # p2p: a middle stage's
    bubble = bubble_theory(lay.schedule, lay.pp, m, lay.stages_per_rank)
    links = link_loads(comm, {"intra": (intra_bw, intra_alpha_us), "inter": (inter_bw, inter_alpha_us)},
                       target_iter_s)
    step = step_time(spec, lay, links, gpus, gb, m, seq, bubble[1], gpu_tflops=gpu_tflops, mfu=mfu)
    warnings = _warnings(spec, lay, mem, m, gpus_per_node, activations_gb) + bandwidth_warnings(step, links)
    balance = plan_balance(spec, lay, seq)  # reported beside the layout; the ranking does not read it
    return Plan(spec.name, spec.params, gpus, gpus_per_node, gpu_mem_gb, lay, gb, mb, m, seq, dtype,
                str(optimizer), mem, comm, links, target_iter_s, *(bubble if lay.pp > 1 else (None, None)),
                warnings=tuple(warnings), notes=tuple(_notes(lay, m, gpus_per_node)) + tuple(layout_notes(lay))
                + tuple(plan_balance_notes(balance, lay)), stages=stages, step=step, stage_balance=balance)


def _base_work(spec: ModelSpec, lay: Layout, dtype: str, mb: int, m: int, seq: int) -> Work:
    """The sizes every rank's traffic shares: batch, dtype, the rank's s/cp tokens, the attention and MoE widths."""
    local = seq // lay.cp
    kv_dim = (spec.kv_heads or spec.heads) * (spec.head_dim or spec.hidden // spec.heads) \
        if spec.heads and spec.hidden else None
    routed = dispatched_tokens(mb, local, spec.top_k, spec.experts, spec.capacity_factor) if spec.experts else 0.0
    return Work(0.0, dtype_bytes(dtype), mb, m, local, spec.hidden, None, vocab=spec.vocab,
                qkv_allreduces=1 if spec.one_tp_input else 3,
                mlp_allreduces=2 if spec.gated_mlp and not spec.one_tp_input else 1, learned_pos=spec.learned_pos,
                dispatched=routed, experts=spec.experts, kv_dim=kv_dim, sharded_ends=spec.sharded_ends,
                norm_bias=spec.bias, sp_between_blocks=spec.sp_between_blocks, tied_table=_tied_table(spec, lay))


def _tied_table(spec: ModelSpec, lay: Layout) -> float:
    """A pipeline rank's elements of a head tied to the embedding (0 when untied or without a pipeline): the table,
    split by vocabulary rows unless the TP plan leaves the ends whole (as ``plan_shape_params`` counts them)."""
    if not spec.tied_embeddings or lay.pp == 1 or spec.vocab is None or spec.hidden is None:
        return 0.0
    return spec.vocab * spec.hidden / (1 if spec.whole_ends else lay.tp)


def _model_problems(spec: ModelSpec, lay: Layout, seq: int) -> list[tuple[str, str]]:
    """What the model refuses of the layout, by the lab's own rules: experts for ep, whole chunks for cp, no
    sequence parallel with experts."""
    return (expert_split_problems(lay.ep, spec.experts) + cp_chunk_problems(lay.cp, seq)
            + moe_layout_problems(spec.experts, lay.sequence_parallel))


def layout_notes(lay: Layout) -> list[str]:
    """What the lab would refuse of a layout the planner sizes (EP beside tp, pp or cp; CP beside pp)."""
    refused = expert_problems(lay.ep, dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, zero=lay.zero,
                              fsdp_strategy=lay.fsdp_strategy, cpu_offload=False)
    refused += context_problems(lay.cp, sequence_parallel=lay.sequence_parallel)
    out = [f"lab.Parallel refuses this layout [{rule}]: {message}; the plan sizes it as a framework that "
           "builds it would run it" for rule, message in refused]
    return out


def _with_dp(parallel: Any, gpus: int, cp: int | None = None) -> Any:
    """A dict without dp gets dp = gpus / (tp·pp·cp), so {"tp": 8} on 32 GPUs means TP8×DP4."""
    if isinstance(parallel, Mapping) and "dp" not in parallel:
        rest = int(parallel.get("tp", 1)) * int(parallel.get("pp", 1)) * int(cp or parallel.get("cp", 1))
        if gpus % rest:
            raise ValueError(f"tp*pp*cp = {rest} does not divide gpus={gpus}")
        return {**parallel, "dp": gpus // rest}
    return parallel


def _get_m(parallel: Any) -> int | None:
    value = parallel.get("microbatches") if isinstance(parallel, Mapping) \
        else getattr(parallel, "microbatches", None)
    return None if value is None else int(value)


def resolve_batch(lay: Layout, global_batch: int | None, micro_batch: int | None,
                  microbatches: int | None) -> tuple[int, int, int]:
    """(global_batch, micro_batch, M) with global_batch = dp · micro_batch · M.

    Missing values are derived; M defaults to ``kernels.contract.layout_rules.default_microbatches``
    (pp, or the stage count for DualPipeV), micro_batch to 1. Raises ValueError when they cannot agree.
    """
    dp = lay.dp
    m = microbatches
    if m is None and global_batch is not None and micro_batch is not None:
        m, rem = divmod(global_batch, dp * micro_batch)
        if rem or m < 1:
            raise ValueError(f"global_batch={global_batch} is not a multiple of dp*micro_batch "
                             f"= {dp}*{micro_batch}")
    if m is None:
        m = default_microbatches(lay.schedule, lay.pp, lay.stages_per_rank)
    if micro_batch is None:
        micro_batch = 1 if global_batch is None else global_batch // (dp * m)
        if global_batch is not None and (micro_batch < 1 or global_batch % (dp * m)):
            raise ValueError(f"global_batch={global_batch} does not split into dp*M = {dp}*{m} "
                             "micro-batches of whole samples")
    if global_batch is None:
        global_batch = dp * micro_batch * m
    if global_batch != dp * micro_batch * m or min(m, micro_batch) < 1:
        raise ValueError(f"global_batch={global_batch} != dp*micro_batch*M = {dp}*{micro_batch}*{m}")
    return global_batch, micro_batch, m


def _warnings(spec: ModelSpec, lay: Layout, mem: MemoryBreakdown, m: int, gpus_per_node: int,
              activations_gb: float | None) -> list[str]:
    out = []
    if not mem.fits:
        out.append(f"does not fit: {mem.total / GB:.1f} GB per GPU > {mem.capacity / GB:.0f} GB")
    if lay.tp > 1 and axis_link(lay, "tp", gpus_per_node) == "inter":
        out.append(f"TP across nodes: tp={lay.tp} with {gpus_per_node} GPUs per node puts every "
                   "block's all-reduces on the inter-node link; keep TP inside a node")
    if lay.tp > 8:
        out.append(f"tp={lay.tp} > 8: the sizing guides take TP=8 as the practical ceiling")
    if lay.pp > 1 and m < lay.pp:
        out.append(f"M={m} < P={lay.pp}: 1F1B needs at least as many micro-batches as stages")
    elif lay.pp > 1 and m < 4 * lay.pp:
        bubble, _ = bubble_theory(lay.schedule, lay.pp, m, lay.stages_per_rank)
        share = f"bubble {bubble:.1%}" if bubble is not None else "a large bubble"
        out.append(f"M={m} < 4P={4 * lay.pp}: {share}; the sizing guides advise M >= 4P")
    if spec.heads is not None and spec.heads % lay.tp:
        out.append(f"heads={spec.heads} not divisible by tp={lay.tp}")
    if spec.layers is not None and lay.stage_layers is None and spec.layers % lay.num_stages:
        out.append(f"layers={spec.layers} not divisible by pp*v={lay.num_stages}: "
                   "stages are uneven; the busiest is sized")
    if not spec.has_shape and activations_gb is None:
        out.append(f"{spec.name} is known by parameter count only: activations are counted as 0 "
                   "and TP/PP traffic is not sized (pass a shape or activations_gb)")
    return out


def _notes(lay: Layout, m: int, gpus_per_node: int) -> list[str]:
    out = []
    if lay.fsdp_strategy == "hybrid":
        inside = groups_link(hybrid_groups(lay)[0], gpus_per_node) == "intra"
        data = f"dp={lay.dp}" if lay.cp == 1 else f"dp*cp={lay.data_ranks}"
        out.append(f"hybrid: {data} as {lay.dp_replicate} replicate x {lay.dp_shard} shard; shard groups "
                   + ("stay inside a node" if inside else "cross nodes: pass dp_replicate to shard inside a node"))
    if lay.zero in (2, 3) and m > 1:
        out.append(f"ZeRO-{lay.zero} over M={m} micro-batches reduce-scatters once a step, so each rank holds its "
                   "gradient whole until then (counted in grads, in float32)"
                   + (" (Hugging Face's multi-GPU guide: ZeRO-1 is the usual choice with PP)" if lay.pp > 1 else ""))
    return out
