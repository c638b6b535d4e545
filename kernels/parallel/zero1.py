"""ZeRO-1: optimizer-state sharding over the dp axis, with torch's ZeroRedundancyOptimizer for plain tensors.

Algorithm: ZeRO stage 1 (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20). Parameters and gradients stay
whole on every dp rank (as in DDP); the AdamW state (exp_avg, exp_avg_sq: K=8 bytes
per fp32 parameter here) is partitioned, so each rank keeps about 1/dp of it (plain
SGD has no state, so ZeRO-1 only splits the update work):

- backward: DDP all_reduces the gradients over the dp group (every rank gets the
  full averaged gradient, but only uses its own partition's);
- step: each rank runs AdamW on the parameters it owns, then every rank's updated
  parameters are broadcast from their owner over the dp group, so all replicas end
  equal again.

ZeRO-2 and ZeRO-3 are FSDP2's ``fully_shard`` (``kernels.parallel.fsdp``).

Two ZeRO-1 optimizers, one choice (``build_zero1_optimizer``, from ``Strategy.zero1_slices``):

- where DDP wraps the model (flat DP over plain tensors): torch's ZeroRedundancyOptimizer, as
  above. It stays the tool there: torch's own, beside DDP, whose all-reduce overlaps backward. It
  owns whole tensors, so a rank holds its greedy partition's state (near, not exactly, 1/dp:
  ``lab.measure.memory_and_comm``);
- where no DDP does (``Strategy.zero1_slices``): TP's DTensors, which DDP and ZeroRedundancyOptimizer
  both refuse (TP x DP, PP x TP x DP), and pipelines, whose loop averages the gradients itself
  (PP x DP): ``kernels.parallel.zero1_slices``, built from torch collectives on the local shards.
  The gradients' local shards are all-reduced over dp before the step, each dp rank steps a 1/dp
  slice of every shard and the slices are all-gathered, so the state splits exactly over dp on top
  of the tp/pp split, which a whole-tensor partition of a stage cannot do.

Run alone (ZeRO-1 on 4 ranks)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 4 --zero 1
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from kernels.parallel.zero1_slices import Zero1SliceOptimizer


def build_zero1_optimizer(model: nn.Module, dp_mesh: DeviceMesh,
                          optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *, slices: bool = False,
                          **settings: Any) -> ZeroRedundancyOptimizer | Zero1SliceOptimizer:
    """An ``optimizer_class`` (AdamW by default) whose state is sharded over the 1D ``dp_mesh``;
    ``settings`` are its keyword args.

    ``slices`` (``Strategy.zero1_slices``: TP, or a pipeline) picks ``Zero1SliceOptimizer``, else
    ZeroRedundancyOptimizer, which partitions plain tensors only. Gradients must already be averaged
    over dp when it steps (DDP, or by hand: a pipeline's loop, or the flat step under ``slices``).
    """
    if slices:
        return Zero1SliceOptimizer(model.parameters(), dp_mesh.get_group(), optimizer_class, **settings)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters: "
                         "build it with slices=True (Strategy.zero1_slices) for tp > 1")
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                   process_group=dp_mesh.get_group(), parameters_as_bucket_view=False, **settings)


def owned_parameters(optimizer: ZeroRedundancyOptimizer, model: nn.Module) -> list[str]:
    """Names of the parameters this rank's partition holds: it keeps their optimizer state and steps them.

    Read from the wrapped per-rank optimizer's parameter groups, not its state: plain SGD
    keeps no state, and yet each rank still updates only its partition.
    """
    local = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    return [name for name, p in model.named_parameters() if id(p) in local]
