"""ZeRO-1: optimizer-state sharding with torch's ZeroRedundancyOptimizer over the dp axis.

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


def build_zero1_optimizer(model: nn.Module, dp_mesh: DeviceMesh,
                          optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                          **settings: Any) -> ZeroRedundancyOptimizer:
    """An ``optimizer_class`` (AdamW by default) whose state is sharded over the 1D ``dp_mesh``;
    ``settings`` are its keyword args.

    ZeroRedundancyOptimizer partitions plain tensors only, so ``model`` must not hold
    DTensors (no TP); gradients must already be averaged over dp (DDP, or by hand in a pipeline).
    """
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters: "
                         "use zero 2/3 with tp > 1")
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                   process_group=dp_mesh.get_group(), parameters_as_bucket_view=False, **settings)


def owned_parameters(optimizer: ZeroRedundancyOptimizer, model: nn.Module) -> list[str]:
    """Names of the parameters this rank's partition holds: it keeps their optimizer state and steps them.

    Read from the wrapped per-rank optimizer's parameter groups, not its state: plain SGD
    keeps no state, and yet each rank still updates only its partition.
    """
    local = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    return [name for name, p in model.named_parameters() if id(p) in local]
