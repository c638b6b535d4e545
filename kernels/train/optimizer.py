"""The run's optimizer: one builder for the one-process reference, every layout and the parameter servers.

``RunConfig.optimizer`` names it (``kernels.contract.config_rules.Optimizer``) and
``RunConfig.optimizer_kwargs`` gives its settings; this module maps the name to torch's class,
so that no path can build one optimizer while the reference builds another. Over DTensor
parameters (TP, FSDP2) the same class steps each rank's local shards
(``kernels.parallel.local_shard_optimizer``): the same update, without DTensor's per-op dispatch.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from kernels.contract.config_rules import Optimizer
from kernels.contract.run_config import RunConfig
from kernels.parallel.local_shard_optimizer import LocalShardOptimizer

CLASSES: dict[Optimizer, type[torch.optim.Optimizer]] = {Optimizer.ADAMW: torch.optim.AdamW,
                                                          Optimizer.SGD: torch.optim.SGD}


def optimizer_class(run: RunConfig) -> type[torch.optim.Optimizer]:
    """torch's class for ``run.optimizer`` (what ZeroRedundancyOptimizer wraps under ZeRO-1)."""
    return CLASSES[run.optimizer]


def build_optimizer(params: Iterable[torch.Tensor], run: RunConfig, device_type: str = "cpu") -> torch.optim.Optimizer:
    """``run``'s optimizer over ``params``, with its settings for ``device_type``; over DTensors, on their shards."""
    params = list(params)
    if any(isinstance(p, DTensor) for p in params):
        return LocalShardOptimizer(params, optimizer_class(run), **run.optimizer_kwargs(device_type))
    return optimizer_class(run)(params, **run.optimizer_kwargs(device_type))
