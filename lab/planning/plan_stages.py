"""Sizing each pipeline rank of a layout: its stages and blocks, parameters after TP, and memory.

``stage_plans`` gives one ``StagePlan`` per pp rank: the stages ``kernels.contract.layout_rules``
places on it, the blocks ``layer_split`` gives those stages, its Ψ after TP, its memory
and its exact traffic (``lab.planning.plan_comm``). A preset splits Ψ evenly over its blocks
(embeddings not singled out); the lab's GPT (``lab.planning.plan_models.gpt_tensors``) is counted
tensor by tensor: TP splits what ``kernels.parallel.tensor_parallel`` splits (tp rank 0's chunk,
the largest) and replicates the norms and row-parallel biases, and PP gives the
embeddings to the first stage, the final norm and LM head to the last.

Memory: parameters, gradients and optimizer states shard by TP and PP, then over the dp
axis as ZeRO says (``lab.planning.plan_math.zero_memory``); activations are b·s·h·L·16 bytes per
micro-batch times the micro-batches the schedule keeps in flight (``in_flight``), split
by TP only under sequence parallelism. Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kernels.contract.layout_rules import layer_split, stage_ids
from lab.planning.plan_comm import CommEntry, Work, all_entries
from lab.planning.plan_math import (ACTIVATION_FACTOR, GB, SELECTIVE_FACTOR, activation_bytes,
                                   checkpointed_activation_bytes, zero_memory)
from lab.planning.plan_mesh import Layout
from lab.planning.plan_models import ModelSpec, gpt_tensors


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on one pipeline rank (in ``Plan.memory``: the busiest one's)."""

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
class StagePlan:
    """One pipeline rank: its stages and blocks, parameters after TP, memory and traffic."""

    pp_rank: int
    stage_ids: tuple[int, ...]  # global stage indices on this rank (kernels.contract.layout_rules.stage_ids)
    layers: int | None  # transformer blocks on this rank
    params: float  # Ψ on this rank after TP and PP, before dp sharding
    memory: MemoryBreakdown
    comm: tuple[CommEntry, ...]  # this rank's traffic, its p2p sends exactly


def stage_params(spec: ModelSpec, lay: Layout, ids: tuple[int, ...]) -> tuple[float, int | None]:
    """(Ψ after TP, blocks) of the pipeline rank holding stages ``ids``.

    A per-tensor model sums its tensors' tp-rank-0 chunks; any other model takes its
    blocks' share of Ψ, divided by tp (140 GB of weights are 17.5 GB per rank under TP8).
    """
    n_stages = lay.num_stages
    if spec.layers is None:
        return spec.params / lay.pp / lay.tp, None
    blocks = {b for s in ids for b in layer_split(spec.layers, n_stages, s)}
    if not spec.per_tensor:
        return spec.params * len(blocks) / spec.layers / lay.tp, len(blocks)
    mine = {"embed": 0 in ids, "head": n_stages - 1 in ids}
    total = sum(t.tp_numel(lay.tp) for t in gpt_tensors(spec)
                if (t.block in blocks if t.owner == "block" else mine[t.owner]))
    return float(total), len(blocks)


def stage_plans(spec: ModelSpec, lay: Layout, base: Work, gpus_per_node: int, k: float, gpu_mem_gb: float,
                activations_gb: float | None) -> tuple[StagePlan, ...]:
    """A StagePlan per pipeline rank: ``base`` (batch and dtype) with that rank's Ψ, blocks and stages."""
    n_stages = lay.num_stages
    out = []
    for r in range(lay.pp):
        ids = stage_ids(lay.schedule, r, lay.pp, lay.stages_per_rank)
        psi, layers = stage_params(spec, lay, ids)
        w = dataclasses.replace(base, psi_local=psi, layers_on_rank=layers, stage_ids=ids, num_stages=n_stages,
                                embed=spec.sharded_ends and 0 in ids, head=spec.sharded_ends and n_stages - 1 in ids)
        mem = stage_memory(lay, w, k, gpu_mem_gb, activations_gb, stage=r)
        out.append(StagePlan(r, ids, layers, psi, mem, all_entries(lay, w, gpus_per_node)))
    return tuple(out)


def stage_memory(lay: Layout, w: Work, k: float, gpu_mem_gb: float, activations_gb: float | None,
                 stage: int = 0) -> MemoryBreakdown:
    """Model states as ZeRO shards them over dp (over dp_shard under HSDP), and the activations in flight."""
    params, grads, opt = zero_memory(w.psi_local, lay.dp_shard, lay.zero, w.elem_bytes, w.elem_bytes, k)
    if activations_gb is not None:
        act = activations_gb * GB
    else:
        act = _activations(lay, w, stage)
    return MemoryBreakdown(params, grads, opt, act, gpu_mem_gb * GB)


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
    one = activation_bytes(w.micro_batch, w.seq_len, w.hidden, w.layers_on_rank, w.elem_bytes)
    if lay.activation_checkpointing == "selective":  # the matmul outputs and block inputs, every block in flight
        total = one * SELECTIVE_FACTOR / ACTIVATION_FACTOR * flight
    elif lay.activation_checkpointing:
        kept = checkpointed_activation_bytes(w.micro_batch, w.seq_len, w.hidden, w.layers_on_rank,
                                             w.elem_bytes)
        block = activation_bytes(w.micro_batch, w.seq_len, w.hidden, 1, w.elem_bytes)
        total = (kept - block) * flight + block  # inputs of every block in flight, one block live
    else:
        total = one * flight
    return total / (lay.tp if lay.sequence_parallel else 1)
