"""Sequence parallelism for a model the user brought: Megatron's SP on an HF decoder's own modules.

Algorithm: sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in
Large Transformer Models"), as ``kernels.parallel.tensor_parallel`` applies it to the lab's GPT: between
the tensor-parallel regions the residual stream holds this rank's T/tp positions, the norms run on
that shard, each attention and MLP all-gathers its input (backward: reduce-scatter) and its row-parallel
output projection reduce-scatters (backward: all-gather).

What differs for an HF model is where the sequence is cut. The model computes its rotary tables,
position ids and causal mask from its embeddings before the first block, so the embedding stays whole
and the first block's input is cut to this rank's shard (``shard_sequence``, a local slice; backward:
all-gather); everything the model built beside its blocks therefore covers the whole sequence, and
each attention sees whole q, k and v. A later pipeline stage receives the shard itself.

The driver (``lab.run.own_models``) lists, from the model's first block, which of a block's children are
norms (run on the shard) and which are the attention and MLP to gather for; a block holding anything
else (a router, a gate) is refused by ``[tp-sp-model]``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel


def whole_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's (B, T/tp, C) shard -> the whole (B, T, C): all-gather (backward: reduce-scatter, through the
    tensor-parallel modules that consume it)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def shard_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole (B, T, C) -> this rank's (B, T/tp, C): a local slice (backward: all-gather)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


class GatherSequence(ParallelStyle):
    """Before the module runs, its hidden-state input (first positional, or ``hidden_states=``) made whole."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args and isinstance(args[0], torch.Tensor):
                return (whole_sequence(args[0], device_mesh), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": whole_sequence(kwargs["hidden_states"], device_mesh)}
        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def sequence_parallel_plans(spec: dict[str, Any], block_plan: dict[str, ParallelStyle],
                            outer_plan: dict[str, ParallelStyle], loss_parallel: bool) -> tuple[dict, dict]:
    """The tensor-parallel plans with sequence parallelism: row-parallel outputs reduce-scattered over the
    sequence, the norms on the shard, the attention and MLP gathering, the head gathering its input."""
    sp, tp_plan = spec["sp"], spec["tp_plan"]
    blocks = f"{spec['pp_plan']['blocks']}.*."
    block = {k: RowwiseParallel(output_layouts=Shard(1)) if tp_plan.get(blocks + k) == "rowwise" else v
             for k, v in block_plan.items()}
    block.update({name: SequenceParallel(use_local_output=True) for name in sp["norms"]})
    block.update({name: GatherSequence() for name in sp["gather"]})
    outer = dict(outer_plan)
    for name in [k for k in outer if tp_plan.get(k) == "colwise_gather_output"]:  # the head, on the shard
        outer[name] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) \
            if loss_parallel else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    outer.update({name: SequenceParallel(use_local_output=True) for name in sp["final_norms"]})
    return block, outer
