"""Activation checkpointing: recompute each transformer block's forward (or the cheap part of it) in backward.

Two modes, per block, with ``torch.utils.checkpoint`` (non-reentrant):

- full (``activation_checkpointing=True``): gradient checkpointing (Chen et al., 2016,
  "Training Deep Nets with Sublinear Memory Cost"). Only each block's input is kept
  from forward; backward runs the block's forward again (its TP collectives included,
  inside the block) before its own backward.
- selective (``activation_checkpointing="selective"``): op-level selective activation
  checkpointing (SAC) as torchtitan applies it, after Korthikanti et al. (2022,
  "Reducing Activation Recomputation in Large Transformer Models", §5), who recompute
  attention's softmax part and keep the matmul outputs. ``torch.utils.checkpoint``'s
  ``create_selective_checkpoint_contexts`` asks ``selective_policy`` about every op of
  the block's forward: the matmul outputs (``SAVED_OPS``) and the collectives' outputs
  (so recomputing runs no communication, torchtitan's choice) are kept; everything
  else is recomputed: SDPA, the norms, GELU, the residual adds. The matmuls are the
  block's FLOPs, so the recompute costs little compute; SDPA is what would keep
  the largest tensors (the a·s² scores in an unfused kernel).

Neither takes a mesh: they change what autograd keeps, not where tensors live.
``observe_selective_saves`` lets ``kernels.measure.memory.SavedActivations`` count what
SAC keeps: those tensors are held in SAC's own cache, not through saved-tensor hooks.

Run alone (TP 2 x FSDP 2 with AC, beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 3 --activation-checkpointing
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kernels.parallel.ring_attention import computing_ring

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional
# The ops whose outputs selective checkpointing keeps: the matmuls (a Linear is addmm or mm under
# its views) and the collectives (TP's all-reduce, SP's all-gather and reduce-scatter).
SAVED_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
                       _c10d.all_reduce.default, _c10d.all_gather_into_tensor.default,
                       _c10d.reduce_scatter_tensor.default, _c10d.wait_tensor.default})

_observers: list[Callable[[Any], None]] = []


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """SAC's policy: keep the output of ``SAVED_OPS``, recompute any other op. Called in forward, after the op ran,
    with its output on ``ctx.op_output``; each observer (``observe_selective_saves``) is shown what is kept."""
    if op not in SAVED_OPS or computing_ring():  # a ring attention's matmuls are its scores: recomputed, as SDPA
        return CheckpointPolicy.PREFER_RECOMPUTE
    for observer in _observers:
        observer(ctx.op_output)
    return CheckpointPolicy.MUST_SAVE


@contextlib.contextmanager
def observe_selective_saves(observer: Callable[[Any], None]) -> Iterator[None]:
    """Call ``observer(output)`` for every op output selective checkpointing keeps inside the body."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def apply_ac(model: nn.Module, mode: bool | str = True) -> nn.Module:
    """Recompute each block of ``model.blocks`` in backward, fully (``True``) or selectively (``"selective"``);
    returns ``model``, changed in place.

    The block's own ``forward`` is replaced, not wrapped in a new module, so parameter names (and
    checkpoints) stay the same with and without AC.
    """
    extra: dict[str, Any] = {}
    if mode == "selective":
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    for block in model.blocks.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)
    return model
