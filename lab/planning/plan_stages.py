"""Sizing each pipeline rank of a layout: its stages and blocks, parameters after TP, and memory.

``stage_plans`` gives one ``StagePlan`` per pp rank: the stages ``kernels.contract.layout_rules``
places on it, the blocks ``layer_split`` gives those stages (equal, or the layout's ``stage_layers``), its Ψ
after TP (and its experts after EP), its memory and its exact traffic (``lab.planning.plan_comm``).
``lab.planning.stage_balance`` proposes the ``stage_layers`` that balance the stages' cost. A preset splits
its parts (``lab.planning.plan_shape_params``): what TP splits divided by tp, what it replicates whole, the
embeddings on the first stage and the final norm and head on the last; its experts go by the MoE layers each
stage holds. The lab's GPT (``lab.planning.plan_tensors.gpt_tensors``) is counted tensor by tensor: TP splits
what ``kernels.parallel.tensor_parallel`` splits (tp rank 0's chunk, the largest) and replicates the norms
and row-parallel biases, and PP gives the embeddings to the first stage, the final norm and LM head to the last.

Memory: parameters, gradients and optimizer states shard by TP and PP, then over the data
axis (dp · cp ranks) as ZeRO says (``lab.planning.plan_math.zero_memory``); under expert parallelism a
rank's E/ep experts are whole (DDP's 2+2+K bytes each), as the lab keeps them outside ZeRO/FSDP. ZeRO-2/3
with more than one micro-batch also holds the accumulating gradient whole (``_with_accumulation``).
Activations are b·(s/cp)·h·L·16 bytes per micro-batch, plus each MoE layer's dispatched tokens and router
probabilities (``plan_math.moe_activation_bytes``), times the micro-batches the schedule keeps in flight
(``in_flight``), split by TP only under sequence parallelism. Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kernels.contract.layout_combinations import stage_split_problems
from kernels.contract.layout_rules import layer_split, stage_ids
from lab.planning.plan_comm import all_entries, sharded_psi
from lab.planning.plan_work import CommEntry, Work
from lab.planning.plan_math import (ACTIVATION_FACTOR, GB, SELECTIVE_FACTOR, activation_bytes,
                                   checkpointed_activation_bytes, moe_activation_bytes, zero_memory)
from lab.planning.plan_mesh import Layout
from lab.planning.plan_models import ModelSpec
from lab.planning.plan_moe import moe_layer_ids, routed_params_in
from lab.planning.plan_shape_params import held_dense
from lab.planning.plan_tensors import gpt_tensors


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on one pipeline rank (in ``Plan.memory``: the busiest one's)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    capacity: float  # gpu_mem_gb × 1e9
    experts: float = 0.0  # of params + grads + optimizer: the routed experts' share (split by ep, ZeRO'd only at ep 1)

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
class StagePlan:
    """One pipeline rank: its stages and blocks, parameters after TP, memory and traffic."""

    pp_rank: int
    stage_ids: tuple[int, ...]  # global stage indices on this rank (kernels.contract.layout_rules.stage_ids)
    layers: int | None  # transformer blocks on this rank
    params: float  # Ψ on this rank after TP, PP and EP, before dp sharding (experts included)
    memory: MemoryBreakdown
    comm: tuple[CommEntry, ...]  # this rank's traffic, its p2p sends exactly
    expert_params: float = 0.0  # of params: the routed experts this rank holds (E/ep of each of its MoE layers)
    moe_layers: int = 0  # MoE layers among its blocks


@dataclass(frozen=True)
class StageParams:
    """What one pipeline rank holds before dp sharding."""

    dense: float  # non-expert Ψ after TP
    experts: float  # routed expert Ψ after EP (TP keeps experts whole)
    layers: int | None  # blocks
    moe_layers: int = 0  # of which MoE layers


def stage_params(spec: ModelSpec, lay: Layout, ids: tuple[int, ...]) -> StageParams:
    """The parameters of the pipeline rank holding stages ``ids``.

    A per-tensor model sums its tensors' tp-rank-0 chunks (experts: E/ep of each packed tensor); a model with a
    shape sums its parts (``plan_shape_params.held_dense``); a count-only one takes its blocks' share of the dense
    Ψ, divided by tp (140 GB of weights are 17.5 GB per rank under TP8); the routed experts of its MoE layers
    are divided by ep.
    """
    n_stages = lay.num_stages
    if spec.layers is None:
        return StageParams(spec.params / lay.pp / lay.tp, 0.0, None)
    blocks = {b for s in ids for b in layer_split(spec.layers, n_stages, s, lay.stage_layers)}
    moe_layers = len(blocks & set(moe_layer_ids(spec)))
    if not spec.per_tensor:
        held = held_dense(spec, lay.tp, blocks, 0 in ids, n_stages - 1 in ids)
        if held is None:  # no shape to tell the parts apart: the blocks' share of the dense count
            held = (spec.params - routed_params_in(spec, set(range(spec.layers)))) * len(blocks) / spec.layers / lay.tp
        return StageParams(held, routed_params_in(spec, blocks) / lay.ep, len(blocks), moe_layers)
    mine = {"embed": 0 in ids, "head": n_stages - 1 in ids}
    held = [t for t in gpt_tensors(spec) if (t.block in blocks if t.owner == "block" else mine[t.owner])]
    dense = sum(t.tp_numel(lay.tp) for t in held if not t.expert)
    return StageParams(float(dense), sum(t.numel for t in held if t.expert) / lay.ep, len(blocks), moe_layers)


def stage_plans(spec: ModelSpec, lay: Layout, base: Work, gpus_per_node: int, k: float, gpu_mem_gb: float,
                activations_gb: float | None) -> tuple[StagePlan, ...]:
    """A StagePlan per pipeline rank: ``base`` (batch and dtype) with that rank's Ψ, blocks and stages."""
    n_stages = lay.num_stages
    if lay.stage_layers is not None and spec.layers is not None:
        for _, message in stage_split_problems(spec.layers, n_stages, lay.stage_layers):
            raise ValueError(message)
    out = []
    for r in range(lay.pp):
        ids = stage_ids(lay.schedule, r, lay.pp, lay.stages_per_rank)
        held = stage_params(spec, lay, ids)
        w = dataclasses.replace(base, psi_local=held.dense, layers_on_rank=held.layers, stage_ids=ids,
                                num_stages=n_stages, expert_psi=held.experts, moe_layers=held.moe_layers,
                                first_stage=0 in ids, last_stage=n_stages - 1 in ids)
        mem = stage_memory(lay, w, k, gpu_mem_gb, activations_gb, stage=r)
        out.append(StagePlan(r, ids, held.layers, held.dense + held.experts, mem, all_entries(lay, w, gpus_per_node),
                             held.experts, held.moe_layers))
    return tuple(out)


def stage_memory(lay: Layout, w: Work, k: float, gpu_mem_gb: float, activations_gb: float | None,
                 stage: int = 0) -> MemoryBreakdown:
    """Model states as ZeRO shards them over the data axis (over dp_shard under HSDP), experts whole under EP,
    and the activations in flight."""
    psi = sharded_psi(lay, w)
    states = _with_accumulation(lay, w, zero_memory(psi, lay.dp_shard, lay.zero, w.elem_bytes, w.elem_bytes, k), psi)
    if lay.ep > 1:
        own = zero_memory(w.expert_psi, 1, 0, w.elem_bytes, w.elem_bytes, k)
        states, experts = tuple(a + b for a, b in zip(states, own)), sum(own)
    else:  # the experts are ZeRO-sharded with everything else: their share of it
        experts = sum(_with_accumulation(lay, w, zero_memory(w.expert_psi, lay.dp_shard, lay.zero, w.elem_bytes,
                                                             w.elem_bytes, k), w.expert_psi))
    act = activations_gb * GB if activations_gb is not None else _activations(lay, w, stage)
    return MemoryBreakdown(*states, act, gpu_mem_gb * GB, experts)


def _with_accumulation(lay: Layout, w: Work, states: tuple[float, float, float],
                       psi: float) -> tuple[float, float, float]:
    """``states`` plus the whole gradient FSDP2 holds while micro-batches accumulate.

    The lab reduces once a step, on the last micro-batch (a pipeline's schedule does the same), so until
    then every FSDP2 unit keeps its gradient whole, in float32 under bf16 (FSDP2's reduce dtype), beside the
    buffer it reduces into: the price of reducing once, not M times. That is ZeRO-2/3, and TP×DP without
    ZeRO or PP, which FSDP2 replicates (DDP cannot take TP's DTensors). A pipeline's schedule also keeps each
    unit whole after every backward but the step's last, so there ZeRO-3's parameters peak whole as ZeRO-2's do.
    """
    replicated = lay.zero == 0 and lay.tp > 1 and lay.data_ranks > 1 and lay.pp == 1  # kernels.contract.strategy
    if (lay.zero < 2 and not replicated) or w.microbatches < 2:
        return states
    params, grads, opt = states
    if lay.pp > 1 and lay.zero == 3:
        params = psi * w.elem_bytes
    return params, grads + psi * max(w.elem_bytes, 4), opt


def in_flight(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak, in units
    of one micro-batch through that rank's blocks.

    GPipe and looped BFS run every forward first: M. 1F1B starts
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
    flight = in_flight(lay.schedule, lay.pp, w.microbatches, lay.stages_per_rank, stage)
    # A MoE layer keeps its dispatched tokens and router probabilities on top of a dense block's estimate.
    moe = moe_activation_bytes(w.micro_batch, w.seq_len, w.dispatched, w.hidden, w.experts, w.elem_bytes) \
        if w.moe_layers else 0.0
    one = activation_bytes(w.micro_batch, w.seq_len, w.hidden, w.layers_on_rank, w.elem_bytes) + moe * w.moe_layers
    if lay.activation_checkpointing == "selective":  # the matmul outputs and block inputs, every block in flight
        total = one * SELECTIVE_FACTOR / ACTIVATION_FACTOR * flight
    elif lay.activation_checkpointing:
        kept = checkpointed_activation_bytes(w.micro_batch, w.seq_len, w.hidden, w.layers_on_rank,
                                             w.elem_bytes)
        block = activation_bytes(w.micro_batch, w.seq_len, w.hidden, 1, w.elem_bytes)
        total = (kept - block) * flight + block + moe  # inputs of every block in flight, one block live
    else:
        total = one * flight
    return total / (lay.tp if lay.sequence_parallel else 1)
