"""Analytic sizing of a training layout: memory per GPU, traffic per link, bubble, warnings.

``plan(model="llama3-70b", gpus=32, gpus_per_node=8, gpu_mem_gb=80, parallel=...)``
returns a frozen ``Plan``. With no ``parallel``, the layout is ``recommend()``'s best.
The formulas live in ``lab.plan_math`` and follow DESIGN §3 and the seeds
(shared/seeds/000, §FSDP/TP/PP): parameters, gradients and optimizer states shard by
TP and PP, then by the dp axis as ZeRO says; activations are the seeds' b·s·h·L·16
bytes per micro-batch, times the micro-batches a schedule keeps in flight (GPipe M,
1F1B P), and are not split by TP unless sequence parallelism is on (seeds/000 TP §1:
"Activations はシャーディングされない"). GB is 1e9 bytes, as in the seeds.
Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from lab import plan_render
from lab.plan_comm import CommEntry, Work, all_entries
from lab.plan_math import (GB, activation_bytes, bubble_fraction, checkpointed_activation_bytes,
                           dtype_bytes, megatron_bubble, optimizer_bytes, required_bandwidth, zero_memory)
from lab.plan_mesh import Layout, axis_link, hybrid_shard_size, layout_from
from lab.plan_models import ModelSpec, get_model


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
    eb = dtype_bytes(dtype)
    work = Work(_psi_local(spec, lay), eb, mb, m, seq, spec.hidden, _layers_on_rank(spec, lay))
    mem = _memory(spec, lay, work, gpus_per_node, optimizer_bytes(optimizer, dtype),
                  gpu_mem_gb, activations_gb)
    comm = all_entries(lay, work, gpus_per_node)
    bubble = (bubble_fraction(lay.pp, m, lay.virtual_stages), megatron_bubble(lay.pp, m, lay.virtual_stages))
    return Plan(spec.name, spec.params, gpus, gpus_per_node, gpu_mem_gb, lay, gb, mb, m, seq, dtype,
                str(optimizer), mem, comm, _links(comm, intra_bw, inter_bw, target_iter_s), target_iter_s,
                *(bubble if lay.pp > 1 else (None, None)),
                warnings=tuple(_warnings(spec, lay, mem, m, gpus_per_node, activations_gb)),
                notes=tuple(_notes(lay, gpus_per_node)))


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


def _layers_on_rank(spec: ModelSpec, lay: Layout) -> int | None:
    """Blocks on pipeline rank 0: ceil(L / pp), since uneven splits load the first stages."""
    return None if spec.layers is None else math.ceil(spec.layers / lay.pp)


def _psi_local(spec: ModelSpec, lay: Layout) -> float:
    """Parameters on the busiest rank: Ψ/(tp·pp), scaled up when stages are uneven.

    Like the seeds (140GB / 8 under TP8), every weight is taken to split evenly;
    embeddings and norms, which are replicated or sit on end stages, are not singled out.
    """
    share = 1.0 / lay.pp
    if spec.layers is not None and lay.pp > 1:
        share = _layers_on_rank(spec, lay) / spec.layers
    return spec.params * share / lay.tp


def _memory(spec: ModelSpec, lay: Layout, w: Work, gpus_per_node: int, k: float, gpu_mem_gb: float,
            activations_gb: float | None) -> MemoryBreakdown:
    n = lay.dp
    if lay.fsdp_strategy == "hybrid":
        n = hybrid_shard_size(lay.dp, lay.tp, gpus_per_node)
    params, grads, opt = zero_memory(w.psi_local, n, lay.zero, w.elem_bytes, w.elem_bytes, k)
    if activations_gb is not None:
        act = activations_gb * GB
    else:
        act = _activations(lay, w)
    return MemoryBreakdown(params, grads, opt, act, gpu_mem_gb * GB)


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations stage 0 holds at its peak, in units of one
    micro-batch through that rank's blocks.

    GPipe and looped BFS run every forward first: M (seeds/000 PP §1). 1F1B and ZB-V
    start backward after P forwards: min(P, M). Interleaved schedules hold
    (1 + (P-1)/(P·v)) times more (Korthikanti et al. 2022 §4.2.3); DualPipeV P+1.
    """
    if p == 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        return min(p, m) * (1 + (p - 1) / (p * v))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    return float(min(p, m))


def _activations(lay: Layout, w: Work) -> float:
    if w.hidden is None or w.layers_on_rank is None:
        return 0.0
    flight = in_flight(lay.schedule, lay.pp, w.microbatches, lay.virtual_stages)
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
