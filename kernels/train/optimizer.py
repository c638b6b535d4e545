"""The run's optimizer: one builder for the one-process reference, every layout and the parameter servers.

``RunConfig.optimizer`` names it (``kernels.contract.config_rules.Optimizer``) and
``RunConfig.optimizer_kwargs`` gives its settings; this module maps the name to torch's class,
so that no path can build one optimizer while the reference builds another.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from kernels.contract.config_rules import Optimizer
from kernels.contract.run_config import RunConfig

CLASSES: dict[Optimizer, type[torch.optim.Optimizer]] = {Optimizer.ADAMW: torch.optim.AdamW,
                                                          Optimizer.SGD: torch.optim.SGD}


def optimizer_class(run: RunConfig) -> type[torch.optim.Optimizer]:
    """torch's class for ``run.optimizer`` (what ZeroRedundancyOptimizer wraps under ZeRO-1)."""
    return CLASSES[run.optimizer]


def build_optimizer(params: Iterable[torch.Tensor], run: RunConfig, device_type: str = "cpu") -> torch.optim.Optimizer:
    """``run``'s optimizer over ``params``, with its settings for ``device_type``."""
    return optimizer_class(run)(params, **run.optimizer_kwargs(device_type))
