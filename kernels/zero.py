"""ZeRO-1: optimizer-state sharding with torch's ZeroRedundancyOptimizer over the dp axis.

Algorithm: ZeRO stage 1 (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20). Parameters and gradients stay
whole on every dp rank (as in DDP); the AdamW state (exp_avg, exp_avg_sq: K=8 bytes
per fp32 parameter here) is partitioned, so each rank keeps about 1/dp of it:

- backward: DDP all_reduces the gradients over the dp group (every rank gets the
  full averaged gradient, but only uses its own partition's);
- step: each rank runs AdamW on the parameters it owns, then every rank's updated
  parameters are broadcast from their owner over the dp group, so all replicas end
  equal again.

ZeRO-2 and ZeRO-3 are FSDP2's ``fully_shard`` (``kernels.fsdp``).

Run alone (ZeRO-1 on 4 ranks)::

    torchrun --nproc-per-node 4 -m kernels.train --dp 4 --zero 1
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer

from kernels.mesh import ParallelDims, dp_group


def apply_zero1(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, **adamw: Any) -> ZeroRedundancyOptimizer:
    """An AdamW whose state is sharded over the dp axis; ``adamw`` are AdamW's keyword args.

    ZeroRedundancyOptimizer partitions plain tensors only, so ``model`` must not hold
    DTensors (no TP); gradients must already be averaged over dp (wrap in DDP first).
    """
    if dims.tp != 1:
        raise ValueError(f"ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters: needs tp=1, got {dims.tp}")
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                   process_group=dp_group(mesh), parameters_as_bucket_view=False, **adamw)


def owned_parameters(optimizer: ZeroRedundancyOptimizer, model: nn.Module) -> list[str]:
    """Names of the parameters whose optimizer state this rank holds (after a step)."""
    local = optimizer.optim.state  # the wrapped per-rank AdamW: state for its partition only
    return [name for name, p in model.named_parameters() if p in local]
