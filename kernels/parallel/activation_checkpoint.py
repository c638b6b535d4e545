"""Activation checkpointing: recompute each transformer block's forward in backward.

Algorithm: gradient checkpointing (Chen et al., 2016, "Training Deep Nets with
Sublinear Memory Cost"), per block, with ``torch.utils.checkpoint`` (non-reentrant).
Only each block's input is kept from forward; backward runs the block's forward again
(its TP collectives included, inside the block) before its own backward. It takes no
mesh: it changes what autograd saves, not where tensors live.

Run alone (TP 2 x FSDP 2 with AC, beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 3 --activation-checkpointing
"""
from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_ac(model: nn.Module) -> nn.Module:
    """Recompute each block of ``model.blocks`` in backward; returns ``model``, changed in place.

    The block's own ``forward`` is replaced, not wrapped in a new module, so parameter names (and
    checkpoints) stay the same with and without AC.
    """
    for block in model.blocks.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model
