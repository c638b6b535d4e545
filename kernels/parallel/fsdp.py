"""ZeRO-2, ZeRO-3 and HSDP with FSDP2 (``fully_shard``), bf16 mixed precision and CPU offload.

Algorithm: fully sharded data parallelism (Zhao et al., 2023, "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB), i.e. ZeRO stages 2/3
(Rajbhandari et al., 2020). FSDP2 turns each parameter into a DTensor sharded on
tensor dim 0 over the dp axis (``Shard(0)``); each ``fully_shard`` unit (one per
transformer block, plus the root for the embeddings, final norm and LM head):

- forward: all_gather the unit's shards into whole parameters before its forward;
  ZeRO-3 (``reshard_after_forward=True``) frees them again after forward, ZeRO-2
  (``False``) keeps them whole until backward. Each unit may choose for itself
  (``reshard_after_forward={"root": False, "blocks": True}``): the root's forward spans
  the whole model and its backward begins at once, so freeing it saves little memory and
  costs one more all-gather of the embeddings and head per step;
- backward: all_gather again if they were freed (ZeRO-3), then reduce_scatter the
  gradients so each rank keeps only its shard of the dp-averaged gradient; the
  optimizer then updates only local shards (sharded AdamW state).

HSDP (hybrid) uses a 2D (dp_replicate, dp_shard) mesh: shards within a shard group
as above, and all_reduces the gradient shards across replicas in backward.

Mixed precision (``MixedPrecisionPolicy``): parameters are all-gathered and used in
bf16, gradients are reduced in fp32 into fp32 sharded master weights.
CPU offload (``CPUOffloadPolicy``): sharded parameters, gradients and optimizer
state live on the CPU; each unit copies to the device before its all-gather.

docs/design.md#gloo-avg-reduction: gloo's AVG reduction was broken before torch 2.13 (#162338), so on gloo
we ask FSDP for SUM plus an explicit divide (``set_force_sum_reduction_for_comms``).

Run alone (ZeRO-3 on 4 ranks, and 2D TP x FSDP)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 4 --zero 3
    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 3
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from kernels.contract.layout_rules import reshard_units
from kernels.parallel.shared_concatenated_meshes import one_mesh_per_pair

_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, zero_stage: int = 3, hybrid: bool = False,
               mixed_precision: str | None = None, cpu_offload: bool = False, prefetch: bool = False,
               ignored_params: set[nn.Parameter] | None = None,
               reshard_after_forward: Mapping[str, bool] | bool | None = None) -> nn.Module:
    """Shard ``model`` with ``fully_shard``: every block first, then the root.

    ``dp_mesh``: the 1D dp sub-mesh, or for ``hybrid`` the 2D (dp_replicate, dp_shard)
    mesh from ``kernels.parallel.mesh.build_hsdp_mesh``. ``zero_stage`` 2 keeps parameters
    whole from forward to backward, 3 frees them after each unit's forward. ``prefetch``
    (a whole model, not a pipeline stage) overlaps all-gathers with compute on a CPU mesh
    too (``_prefetch_on_cpu``). ``ignored_params`` stay as they are, unsharded and unreduced: expert
    parallelism's DTensor experts (``kernels.parallel.expert_parallel``). ``reshard_after_forward``
    per unit ({"root": ..., "blocks": ...}, ``layout_rules.reshard_units``; a unit left out, or None,
    follows ``zero_stage``) is passed to each unit's ``fully_shard`` as given, never FSDP2's automatic
    choice, so what a unit does is what the layout says.
    """
    if zero_stage not in (2, 3):
        raise ValueError(f"apply_fsdp: zero_stage must be 2 or 3, got {zero_stage!r}")
    if hybrid != (dp_mesh.ndim == 2):
        raise ValueError(f"apply_fsdp: hybrid={hybrid} needs a {'2D' if hybrid else '1D'} mesh, got {dp_mesh.ndim}D")
    units = reshard_units(zero_stage, dict(reshard_after_forward) if isinstance(reshard_after_forward, Mapping)
                          else reshard_after_forward)
    options: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=_DTYPES[mixed_precision], reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
        "ignored_params": ignored_params or None,
    }
    # Units are blocks: each all-gathers only its own parameters, so at most about
    # one block is whole at a time under ZeRO-3 (plus the root's, gathered for the
    # embeddings at the start of forward and the LM head at the end).
    with one_mesh_per_pair():  # over TP, each parameter would get a (dp, tp) mesh built for it alone
        for block in model.blocks.values():
            fully_shard(block, reshard_after_forward=units["blocks"], **options)
        fully_shard(model, reshard_after_forward=units["root"], **options)
    if _is_gloo(dp_mesh):
        # Every unit sums its reduce_scatter/all_reduce and divides afterwards (gloo AVG bug).
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    if prefetch and dp_mesh.device_type == "cpu":
        _prefetch_on_cpu(model)
    return model


def _prefetch_on_cpu(model: nn.Module) -> None:
    """Gather the next unit while this one computes, on the CPU as FSDP2 does on a GPU.

    On a GPU FSDP2 overlaps by streams: the next unit's all-gather runs on its own stream while
    the host runs ahead. CPU streams are no-ops, so there every all-gather would block the rank
    before its unit. Async unshards (a private switch: torch has no public one) put the all-gather
    on gloo's thread, and explicit forward prefetching issues unit i+1's as unit i starts (the root
    issues the first block's); backward prefetches the previous unit by default. The maths is the
    same; one more unit is whole at a time, as on a GPU (docs/design.md#overlap-model-flops-and-mfu).
    """
    blocks = list(model.blocks.values())
    model._set_unshard_async_op(True)  # every FSDP unit under the root
    for unit, following in zip([model, *blocks], blocks):
        unit.set_modules_to_forward_prefetch([following])


def block_unit_names(model: nn.Module) -> list[str]:
    """The names of the blocks ``apply_fsdp`` shards as units of their own; every other parameter is the root's."""
    blocks = {id(block) for block in model.blocks.values()}
    return [name for name, module in model.named_modules() if id(module) in blocks]


def _is_gloo(mesh: DeviceMesh) -> bool:
    return all(dist.get_backend(g) == "gloo" for g in mesh.get_all_groups())


def describe_params(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: global shape, this rank's local shape, placements and mesh axes."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            out[name] = {"global_shape": list(p.shape), "local_shape": list(local.shape),
                         "placements": [str(pl) for pl in p.placements],
                         "mesh_axes": list(p.device_mesh.mesh_dim_names or ()), "dtype": str(local.dtype)}
        else:
            out[name] = {"global_shape": list(p.shape), "local_shape": list(p.shape),
                         "placements": [], "mesh_axes": [], "dtype": str(p.dtype)}
    return out


def unsharded_grads(model: nn.Module) -> list[torch.Tensor]:
    """The whole gradients FSDP2 holds off the registered parameters: a unit's accumulation when a backward skipped
    its reduce-scatter (``set_requires_gradient_sync(False)``).

    A resharded unit (ZeRO-3) keeps its earlier micro-batches' gradient on the unsharded parameter it no
    longer registers, or, under a reduce dtype, in ``unsharded_accumulated_grad``; neither shows on
    ``model.parameters()``. Both are private attributes of ``FSDPParam``: a torch without them yields none.
    """
    out: list[torch.Tensor] = []
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            unsharded = getattr(param, "_unsharded_param", None)
            for grad in (getattr(unsharded, "grad", None), getattr(param, "unsharded_accumulated_grad", None)):
                if grad is not None:
                    out.append(grad)
    return out


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective for DTensors: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = full.detach().to("cpu", torch.float32)
    return out
