"""Sequence parallelism for a model the user brought: Megatron's SP on an HF decoder's own modules.

Algorithm: sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in
Large Transformer Models"), as ``kernels.parallel.tensor_parallel`` applies it to the lab's GPT: between
the tensor-parallel regions the residual stream holds this rank's T/tp positions, the norms run on
that shard, each attention and MLP all-gathers its input (backward: reduce-scatter) and its row-parallel
output projection reduce-scatters (backward: all-gather).

What differs for a model the user brought is where the sequence is cut. An HF model computes its
rotary tables, position ids and causal mask from its embeddings before the first block, so the
embedding stays whole and the first block's input is cut to this rank's shard (``shard_sequence``, a
local slice; backward: all-gather); everything the model built beside its blocks therefore covers the
whole sequence, and each attention sees whole q, k and v. A later pipeline stage receives the shard itself.

``sequence_parallel_layout`` reads, once on the driver from the model's first block, what each of a
block's children is: a norm (run on the shard), an attention or MLP whose plan splits it column- then
row-wise, or a column-parallel Linear itself (each gathers the sequence first), or a row-parallel one
(reduce-scatters). A block holding anything else (a router, a gate, a Linear the plan leaves whole)
cannot run on a shard, and ``[tp-sp-model]`` refuses it with that child's name. The last block's output
is gathered whole again, so what follows the blocks (the final norm, the head, the model's own reshapes
of the hidden state: GPT-2 views it as (-1, T, C)) runs as without sequence parallelism; the final norm's
activations are then whole, one norm's worth more than Megatron keeps.
"""
from __future__ import annotations

from typing import Any, Callable

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


def on_hidden_states(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward pre-hook (``with_kwargs=True``) that replaces a block's hidden-state input, the first positional
    argument or ``hidden_states=`` (how HF blocks and a ``lab.Model``'s are called), by ``change`` of it."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (change(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    return hook


class GatherSequence(ParallelStyle):
    """Before the module runs, its hidden-state input made whole."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(on_hidden_states(lambda x: whole_sequence(x, device_mesh)), with_kwargs=True)
        return module


def _from_sequence_shard(style: ParallelStyle) -> ParallelStyle:
    """A column-parallel style that takes the (B, T/tp, C) shard and all-gathers it (backward: reduce-scatter)."""
    style.input_layouts = (Shard(1),)
    return style


def _to_sequence_shard(style: ParallelStyle) -> ParallelStyle:
    """A row-parallel style whose summed output is reduce-scattered over the sequence (backward: all-gather)."""
    style.output_layouts = (Shard(1),)
    return style


def sequence_parallel_plans(spec: dict[str, Any], block_plan: dict[str, ParallelStyle]) -> dict:
    """A block's tensor-parallel plan with sequence parallelism: row-parallel outputs reduce-scattered over
    the sequence, the norms on the shard, the attention and MLP (or a column-parallel Linear) gathering it."""
    sp = spec["sp"]
    block = {k: _to_sequence_shard(v) if isinstance(v, RowwiseParallel) else v for k, v in block_plan.items()}
    block.update({name: SequenceParallel(use_local_output=True) for name in sp["norms"]})
    for name in sp["gather"]:
        planned = block.get(name)
        block[name] = _from_sequence_shard(planned) if isinstance(planned, ColwiseParallel) else GatherSequence()
    return block


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Norm")


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def sequence_parallel_layout(meta: nn.Module, tp_plan: dict[str, str], blocks: str | None) -> dict[str, Any]:
    """What sequence parallelism does with a block's children (module docstring), read on the meta device:
    ``norms`` and ``gather``; or ``{"why_not": reason}`` where the model cannot run on sequence shards."""
    if not blocks:
        return {"why_not": "it names no block list (blocks=), so no block input is known to cut"}
    norms, gather = [], []
    for name, child in next(iter(meta.get_submodule(blocks).children())).named_children():
        own = tp_plan.get(f"{blocks}.*.{name}", "")
        inside = [v for k, v in tp_plan.items() if k.startswith(f"{blocks}.*.{name}.")]
        if _is_norm(child):
            norms.append(name)
        elif "colwise" in own or (any("colwise" in v for v in inside) and any("rowwise" in v for v in inside)):
            gather.append(name)
        elif "rowwise" not in own and _holds_parameters(child):
            return {"why_not": f"a block's {name!r} ({type(child).__name__}) is neither a norm nor split by the "
                    "plan column- then row-wise, so it cannot run on a sequence shard"}
    if not gather:
        return {"why_not": "the plan splits nothing in a block column-wise, so there is no region to gather for"}
    return {"norms": norms, "gather": gather}
