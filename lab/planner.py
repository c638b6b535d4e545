"""Analytic sizing of a training layout: memory per GPU, traffic per link, bubble, warnings.

``plan(model="llama3-70b", gpus=32, gpus_per_node=8, gpu_mem_gb=80, parallel=...)``
returns a frozen ``Plan``. With no ``parallel``, the layout is ``recommend()``'s best.
The formulas live in ``lab.plan_math`` and follow DESIGN §3 and the seeds
(shared/seeds/000, §FSDP/TP/PP): parameters, gradients and optimizer states shard by
TP and PP, then by the dp axis as ZeRO says; activations are the seeds' b·s·h·L·16
bytes per micro-batch, times the micro-batches a schedule keeps in flight (GPipe M,
1F1B P), and are not split by TP unless sequence parallelism is on (seeds/000 TP §1:
"Activations はシャーディングされない"). GB is 1e9 bytes, as in the seeds.

Every pipeline rank is sized (``Plan.stages``, one ``StagePlan`` per pp rank: its
stages, blocks, parameters, memory and exact traffic); ``Plan.memory`` and the dp/tp
part of ``Plan.comm`` are the busiest rank's, and ``Plan.comm``'s p2p is a middle
stage's (the busiest link). A preset splits Ψ evenly over its blocks (the seeds'
convention, embeddings not singled out); the lab's GPT (``ModelSpec.from_gpt``, or a
``GPTConfig``/its dict as ``model``) is counted tensor by tensor: TP splits what
``kernels.tensor_parallel`` splits (tp rank 0's chunk, the largest) and replicates
the norms and row-parallel biases, and PP gives the embeddings to the first stage,
the final norm and LM head to the last, blocks in equal contiguous runs.
Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from lab import plan_render
from lab.plan_comm import CommEntry, Work, all_entries
from lab.plan_math import (
    GB,
    activation_bytes,
    bubble_fraction,
    checkpointed_activation_bytes,
    dtype_bytes,
    megatron_bubble,
    optimizer_bytes,
    required_bandwidth,
    zero_memory,
)
from lab.plan_mesh import MULTI_STAGE, Layout, axis_link, hybrid_shard_size, layout_from
from lab.plan_models import ModelSpec, get_model, gpt_tensors


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the busiest rank (pipeline stage 0)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    capacity: float  # gpu_mem_gb × 1e9

    @property
    def total(self) -> float:
        """params + grads + optimizer + activations."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        """True when the total fits the GPU."""
        return self.total <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields, with total and fits."""
        return {**dataclasses.asdict(self), "total": self.total, "fits": self.fits}


@dataclass(frozen=True)
class LinkLoad:
    """One link's share of an iteration: bytes one rank sends, time, and bandwidth needed."""

    link: str  # "intra" or "inter"
    bandwidth_gbps: float  # the link's bandwidth in GB/s (1e9 bytes/s) as given to plan()
    wire_bytes: float
    time_s: float  # wire_bytes / bandwidth, with no overlap
    needed_gbps: float  # GB/s to move wire_bytes within the target iteration time


@dataclass(frozen=True)
class StagePlan:
    """One pipeline rank: its stages and blocks, parameters after TP, memory and traffic."""

    pp_rank: int
    stage_ids: tuple[int, ...]  # global stage indices on this rank (kernels.pipeline's placement)
    layers: int | None  # transformer blocks on this rank
    params: float  # Ψ on this rank after TP and PP, before dp sharding
    memory: MemoryBreakdown
    comm: tuple[CommEntry, ...]  # this rank's traffic, its p2p sends exactly


@dataclass(frozen=True)
class Plan:
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
    bubble: float | None  # (p-1)/(m+p-1) or (p-1)/(v·m+p-1); None without PP
    bubble_megatron: float | None  # (p-1)/m or (p-1)/(v·m)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    stages: tuple[StagePlan, ...] = ()  # one per pipeline rank

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
        return out

    def __str__(self) -> str:
        return plan_render.text(self)

    def __repr__(self) -> str:
        return plan_render.text(self)

    def _repr_html_(self) -> str:
        return plan_render.html(self)


def plan(model: str | float | ModelSpec | Mapping[str, Any], gpus: int, gpus_per_node: int = 8,
         gpu_mem_gb: float = 80.0, intra_bw: float = 900.0, inter_bw: float = 400.0,
         parallel: Any = None, global_batch: int | None = None, micro_batch: int | None = None,
         seq_len: int | None = None, dtype: str = "bf16", optimizer: str | float = "adam",
         activation_checkpointing: bool | None = None, schedule: str | None = None,
         microbatches: int | None = None, target_iter_s: float = 1.0,
         activations_gb: float | None = None) -> Plan:
    """Size one layout analytically.

    ``parallel``: a ``lab.parallel.Parallel``, any object with its attributes, or a dict
    (dp may be left out of a dict: it is gpus / (tp·pp)); None asks ``recommend()``.
    ``intra_bw``/``inter_bw``: GB/s per GPU inside a node and between nodes (defaults:
    the seeds' NVLink 900GB/s and EFA 3,200Gbps = 400GB/s). ``schedule`` and
    ``activation_checkpointing`` default to the parallel object's, else "1f1b" and off.
    ``optimizer``: "adam" (K=12, DESIGN §3), "adam_bf16" (K=4, the seeds/000 convention),
    "sgd", "sgd_momentum", or K itself. ``activations_gb`` replaces the activation
    estimate (the seeds' TP example assumes 20GB). Raises ValueError when dp·tp·pp ≠ gpus.
    """
    spec = get_model(model)
    if parallel is None:
        return _recommended(spec, gpus, gpus_per_node, gpu_mem_gb, dict(
            intra_bw=intra_bw, inter_bw=inter_bw, global_batch=global_batch, micro_batch=micro_batch,
            seq_len=seq_len, dtype=dtype, optimizer=optimizer, microbatches=microbatches,
            activation_checkpointing=activation_checkpointing, schedule=schedule or "1f1b",
            target_iter_s=target_iter_s, activations_gb=activations_gb))
    lay = layout_from(_with_dp(parallel, gpus), schedule=schedule,
                      activation_checkpointing=activation_checkpointing)
    if lay.world != gpus:
        raise ValueError(f"dp*tp*pp = {lay.dp}*{lay.tp}*{lay.pp} = {lay.world} must equal gpus={gpus}")
    m_default = microbatches if microbatches is not None else _get_m(parallel)
    gb, mb, m = resolve_batch(lay, global_batch, micro_batch, m_default)
    seq = seq_len or spec.seq_len
    base = Work(0.0, dtype_bytes(dtype), mb, m, seq, spec.hidden, None, vocab=spec.vocab,
                qkv_allreduces=1 if spec.fused_qkv else 3)
    stages = stage_plans(spec, lay, base, gpus_per_node, optimizer_bytes(optimizer, dtype), gpu_mem_gb,
                         activations_gb)
    busiest = max(stages, key=lambda st: st.memory.total)  # the first on ties
    work = dataclasses.replace(base, psi_local=busiest.params, layers_on_rank=busiest.layers,
                               embed=spec.per_tensor and 0 in busiest.stage_ids,
                               head=spec.per_tensor and lay.pp * lay.virtual_stages - 1 in busiest.stage_ids)
    mem, comm = busiest.memory, all_entries(lay, work, gpus_per_node)  # p2p: a middle stage's
    bubble = (bubble_fraction(lay.pp, m, lay.virtual_stages), megatron_bubble(lay.pp, m, lay.virtual_stages))
    return Plan(spec.name, spec.params, gpus, gpus_per_node, gpu_mem_gb, lay, gb, mb, m, seq, dtype,
                str(optimizer), mem, comm, _links(comm, intra_bw, inter_bw, target_iter_s), target_iter_s,
                *(bubble if lay.pp > 1 else (None, None)),
                warnings=tuple(_warnings(spec, lay, mem, m, gpus_per_node, activations_gb)),
                notes=tuple(_notes(lay, gpus_per_node)), stages=stages)


def _with_dp(parallel: Any, gpus: int) -> Any:
    """A dict without dp gets dp = gpus / (tp·pp), so {"tp": 8} on 32 GPUs means TP8×DP4."""
    if isinstance(parallel, Mapping) and "dp" not in parallel:
        rest = int(parallel.get("tp", 1)) * int(parallel.get("pp", 1))
        if gpus % rest:
            raise ValueError(f"tp*pp = {rest} does not divide gpus={gpus}")
        return {**parallel, "dp": gpus // rest}
    return parallel


def _get_m(parallel: Any) -> int | None:
    value = parallel.get("microbatches") if isinstance(parallel, Mapping) \
        else getattr(parallel, "microbatches", None)
    return None if value is None else int(value)


def resolve_batch(lay: Layout, global_batch: int | None, micro_batch: int | None,
                  microbatches: int | None) -> tuple[int, int, int]:
    """(global_batch, micro_batch, M) with global_batch = dp · micro_batch · M.

    Missing values are derived; M defaults to the stage count (lab.parallel's default),
    micro_batch to 1. Raises ValueError when they cannot agree.
    """
    dp = lay.dp
    m = microbatches
    if m is None and global_batch is not None and micro_batch is not None:
        m, rem = divmod(global_batch, dp * micro_batch)
        if rem or m < 1:
            raise ValueError(f"global_batch={global_batch} is not a multiple of dp*micro_batch "
                             f"= {dp}*{micro_batch}")
    if m is None:
        m = lay.pp * (lay.virtual_stages if lay.schedule == "dualpipev" else 1)
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


def stage_ids(schedule: str, pp_rank: int, pp: int, v: int = 1) -> tuple[int, ...]:
    """Global stages on ``pp_rank`` (kernels.pipeline.stage_ids_for_rank's placement):
    [r] for GPipe/1F1B, the V [r, 2p-1-r] for ZBV/DualPipeV, else looped [r, r+p, ...]."""
    if schedule not in MULTI_STAGE:
        return (pp_rank,)
    if schedule in ("zbv", "dualpipev"):
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(v))


def stage_blocks(layers: int, num_stages: int) -> list[range]:
    """Contiguous block indices per stage: equal runs, the first ``layers % num_stages`` one longer."""
    per, extra = divmod(layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = per + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_params(spec: ModelSpec, lay: Layout, ids: tuple[int, ...]) -> tuple[float, int | None]:
    """(Ψ after TP, blocks) of the pipeline rank holding stages ``ids``.

    A per-tensor model sums its tensors' tp-rank-0 chunks; any other model takes its
    blocks' share of Ψ, divided by tp (the seeds: "140GB / 8" under TP8).
    """
    n_stages = lay.pp * (lay.virtual_stages if lay.schedule in MULTI_STAGE else 1)
    if spec.layers is None:
        return spec.params / lay.pp / lay.tp, None
    runs = stage_blocks(spec.layers, n_stages)
    blocks = {b for s in ids for b in runs[s]}
    if not spec.per_tensor:
        return spec.params * len(blocks) / spec.layers / lay.tp, len(blocks)
    mine = {"embed": 0 in ids, "head": n_stages - 1 in ids}
    total = sum(t.tp_numel(lay.tp) for t in gpt_tensors(spec)
                if (t.block in blocks if t.owner == "block" else mine[t.owner]))
    return float(total), len(blocks)


def stage_plans(spec: ModelSpec, lay: Layout, base: Work, gpus_per_node: int, k: float, gpu_mem_gb: float,
                activations_gb: float | None) -> tuple[StagePlan, ...]:
    """A StagePlan per pipeline rank: ``base`` (batch and dtype) with that rank's Ψ, blocks and stages."""
    n_stages = lay.pp * (lay.virtual_stages if lay.schedule in MULTI_STAGE else 1)
    out = []
    for r in range(lay.pp):
        ids = stage_ids(lay.schedule, r, lay.pp, lay.virtual_stages)
        psi, layers = stage_params(spec, lay, ids)
        w = dataclasses.replace(base, psi_local=psi, layers_on_rank=layers, stage_ids=ids, num_stages=n_stages,
                                embed=spec.per_tensor and 0 in ids, head=spec.per_tensor and n_stages - 1 in ids)
        mem = _memory(spec, lay, w, gpus_per_node, k, gpu_mem_gb, activations_gb, stage=r)
        out.append(StagePlan(r, ids, layers, psi, mem, all_entries(lay, w, gpus_per_node)))
    return tuple(out)


def _memory(spec: ModelSpec, lay: Layout, w: Work, gpus_per_node: int, k: float, gpu_mem_gb: float,
            activations_gb: float | None, stage: int = 0) -> MemoryBreakdown:
    n = lay.dp
    if lay.fsdp_strategy == "hybrid":
        n = hybrid_shard_size(lay.dp, lay.tp, gpus_per_node)
    params, grads, opt = zero_memory(w.psi_local, n, lay.zero, w.elem_bytes, w.elem_bytes, k)
    if activations_gb is not None:
        act = activations_gb * GB
    else:
        act = _activations(lay, w, stage)
    return MemoryBreakdown(params, grads, opt, act, gpu_mem_gb * GB)


def in_flight(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak, in units
    of one micro-batch through that rank's blocks.

    GPipe and looped BFS run every forward first: M (seeds/000 PP §1). 1F1B starts
    backward after P - stage forwards: min(P - stage, M); ZB-V is sized as stage 0,
    min(P, M). Interleaved schedules hold (1 + (P-1)/(P·v)) times more (Korthikanti
    et al. 2022 §4.2.3); DualPipeV P+1. Those are stage 0's figures, used for every rank.
    """
    if p == 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        return min(p, m) * (1 + (p - 1) / (p * v))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    return float(min(p - stage if schedule == "1f1b" else p, m))


def _activations(lay: Layout, w: Work, stage: int = 0) -> float:
    if w.hidden is None or w.layers_on_rank is None:
        return 0.0
    flight = in_flight(lay.schedule, lay.pp, w.microbatches, lay.virtual_stages, stage)
    one = activation_bytes(w.micro_batch, w.seq_len, w.hidden, w.layers_on_rank, w.elem_bytes)
    if lay.activation_checkpointing:
        kept = checkpointed_activation_bytes(w.micro_batch, w.seq_len, w.hidden, w.layers_on_rank,
                                             w.elem_bytes)
        block = activation_bytes(w.micro_batch, w.seq_len, w.hidden, 1, w.elem_bytes)
        total = (kept - block) * flight + block  # inputs of every block in flight, one block live
    else:
        total = one * flight
    return total / (lay.tp if lay.sequence_parallel else 1)


def _links(comm: tuple[CommEntry, ...], intra_bw: float, inter_bw: float,
           target_iter_s: float) -> tuple[LinkLoad, ...]:
    out = []
    for name, bw in (("intra", intra_bw), ("inter", inter_bw)):
        wire = sum(e.wire_bytes for e in comm if e.link == name)
        out.append(LinkLoad(name, bw, wire, wire / (bw * GB) if bw > 0 else math.inf,
                            required_bandwidth(wire, target_iter_s)))
    return tuple(out)


def _warnings(spec: ModelSpec, lay: Layout, mem: MemoryBreakdown, m: int, gpus_per_node: int,
              activations_gb: float | None) -> list[str]:
    out = []
    if not mem.fits:
        out.append(f"does not fit: {mem.total / GB:.1f} GB per GPU > {mem.capacity / GB:.0f} GB")
    if lay.tp > 1 and axis_link(lay, "tp", gpus_per_node) == "inter":
        out.append(f"TP across nodes: tp={lay.tp} with {gpus_per_node} GPUs per node puts every "
                   "block's all-reduces on the inter-node link; keep TP inside a node")
    if lay.tp > 8:
        out.append(f"tp={lay.tp} > 8: the seeds take TP=8 as the practical ceiling")
    if lay.pp > 1 and m < lay.pp:
        out.append(f"M={m} < P={lay.pp}: 1F1B needs at least as many micro-batches as stages")
    elif lay.pp > 1 and m < 4 * lay.pp:
        out.append(f"M={m} < 4P={4 * lay.pp}: bubble {bubble_fraction(lay.pp, m, lay.virtual_stages):.1%};"
                   " the seeds advise M >= 4P")
    if spec.heads is not None and spec.heads % lay.tp:
        out.append(f"heads={spec.heads} not divisible by tp={lay.tp}")
    if spec.layers is not None and spec.layers % (lay.pp * lay.virtual_stages):
        out.append(f"layers={spec.layers} not divisible by pp*v={lay.pp * lay.virtual_stages}: "
                   "stages are uneven; the busiest is sized")
    if not spec.has_shape and activations_gb is None:
        out.append(f"{spec.name} is known by parameter count only: activations are counted as 0 "
                   "and TP/PP traffic is not sized (pass a shape or activations_gb)")
    return out


def _notes(lay: Layout, gpus_per_node: int) -> list[str]:
    out = []
    if lay.fsdp_strategy == "hybrid":
        out.append(f"hybrid: shard over {hybrid_shard_size(lay.dp, lay.tp, gpus_per_node)} dp ranks "
                   "inside a node, replicate across nodes")
    if lay.zero in (2, 3) and lay.pp > 1:
        out.append(f"ZeRO-{lay.zero} with PP all-gathers/reduce-scatters per micro-batch "
                   "(seeds/004: ZeRO-1 is the usual choice with PP)")
    return out


def _recommended(spec: ModelSpec, gpus: int, gpus_per_node: int, gpu_mem_gb: float,
                 kwargs: dict[str, Any]) -> Plan:
    from lab.recommend import recommend  # recommend() calls plan(): import when needed

    best = recommend(spec, gpus, gpus_per_node, gpu_mem_gb, **kwargs).best
    return dataclasses.replace(best.plan, notes=best.plan.notes + (f"layout from recommend(): {best.reason}",))
