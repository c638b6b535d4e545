"""``train_rank``'s pp > 1 path: pipeline stages composed with DP, ZeRO/FSDP and TP on one mesh.

Algorithm: micro-batched pipeline parallelism (GPipe, Huang et al., 2019; 1F1B,
Narayanan et al., 2019; the interleaved, zero-bubble and V schedules listed in
``kernels.pipeline``) on the pp axis of the (pp, dp, tp) mesh, Megatron's 3D
layout (Narayanan et al., 2021). Each rank builds its stages with
``kernels.pipeline.build_pipeline``, whose ``model_transform`` hook runs
``kernels.train.parallelize`` on every stage module: TP on the tp axis, then
activation checkpointing, then FSDP on the dp axis (ZeRO-2/3, as torchtitan does).
Without FSDP, gradients meet over dp after the schedule: one all_reduce(SUM) per
gradient, then / dp (``average_gradients``), shard by shard for TP DTensors.

Per step, the loss exists only on the rank holding the last stage (pp rank p-1, or
pp rank 0 for zbv/dualpipev): it is all_reduced over the pp group (one rank adds
a non-zero value: a broadcast) and then averaged over dp, so every rank, rank 0
included, reports the global-batch mean. The gradient norm is summed in squares
over the pipeline's stages the same way.

Run alone (PP 2 x DP 2 with the ZBV schedule, beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train --pp 2 --dp 2 --schedule zbv --layers 4 --microbatches 4
"""
from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kernels import pipeline
from kernels.data import shard_batch
from kernels.fsdp import describe_params, full_parameters
from kernels.mesh import ParallelDims, dp_group, dp_rank, pp_group, pp_rank
from kernels.model import loss_fn, stage_layers
from kernels.reference import adamw_kwargs, dataset, model_config, run_settings
from kernels.train import grad_norm, layout_plan, parallelize
from kernels.zero import apply_zero1, owned_parameters


def train_pipeline(cfg: dict[str, Any], dims: ParallelDims, mesh, device: torch.device, dp_mesh=None) -> dict[str, Any]:
    """pp > 1: kernels.pipeline's stages, each parallelized (TP -> AC -> FSDP) by its model_transform hook."""
    plan, settings, data = layout_plan(cfg, dims), run_settings(cfg), dataset(cfg)
    schedule = cfg.get("schedule", "1f1b")
    stages = int(cfg.get("virtual_stages") or (1 if schedule in pipeline.SINGLE_STAGE else 2))
    transform = functools.partial(parallelize, cfg=cfg, dims=dims, mesh=mesh, plan=plan,
                                  dp_mesh=dp_mesh)
    runtime = pipeline.build_pipeline(model_config(cfg), schedule, pp_rank(mesh), dims.pp, stages,
                                      int(cfg.get("microbatches") or dims.pp), pp_group(mesh), device, loss_fn,
                                      model_transform=transform)
    stack = nn.ModuleList(runtime.modules)  # this rank's stages as one module, for the optimizer and norms
    optimizer = (apply_zero1(stack, dims, mesh, **adamw_kwargs(settings)) if plan["kind"] == "zero1"
                 else torch.optim.AdamW(stack.parameters(), **adamw_kwargs(settings)))
    losses, times, norms = [], [], []
    for step in range(settings["steps"]):
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T) each
        inputs, targets = shard_batch(inputs, targets, dp_rank(mesh), dims.dp)  # (B/dp, T)
        start = time.perf_counter()
        loss = pipeline.pipeline_step(runtime, inputs, targets)  # float on the last stage, else None
        if plan["kind"] in ("allreduce", "zero1") and dims.dp > 1:
            average_gradients(stack, dp_group(mesh))
        if cfg.get("record_grad_norm", True):  # this rank's stages, then summed in squares over the pipeline
            sq = torch.tensor(grad_norm(stack) ** 2, dtype=torch.float64, device=device)
            dist.all_reduce(sq, group=pp_group(mesh))
            norms.append(sq.item() ** 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        # Reporting only: the replica's loss from its last stage to every pp rank, then the mean over dp.
        total = pipeline.share_loss(loss, pp_group(mesh), device)
        dist.all_reduce(total, group=dp_group(mesh))
        losses.append(total.item() / dims.dp)
    out = {"losses": losses, "grad_norms": norms, "step_times": times}
    return {**out, **_pipeline_records(cfg, dims, runtime, plan, optimizer)}


def _pipeline_records(cfg: dict[str, Any], dims: ParallelDims, runtime, plan: dict[str, Any], optimizer):
    """The layout record (stages, their layers, per-parameter shapes) and the whole parameters of this rank's stages."""
    rank, layers = dist.get_rank(), model_config(cfg).layers
    layout = {"rank": rank, "coords": dims.coords(rank), "strategy": f"pp-{runtime.schedule_name}",
              "dp_strategy": plan["kind"], "zero": plan["zero"], "hybrid": plan["hybrid"],
              "schedule": runtime.schedule_name, "stage_ids": list(runtime.stage_ids),
              "stage_layers": {str(s): list(stage_layers(layers, runtime.num_stages, s)) for s in runtime.stage_ids},
              "params": {k: v for module in runtime.modules for k, v in describe_params(module).items()}}
    if plan["kind"] == "zero1":  # ModuleList names are "<index>.<parameter name>"
        layout["optimizer_params"] = [n.split(".", 1)[1] for n in
                                      owned_parameters(optimizer, nn.ModuleList(runtime.modules))]
    params = {}
    if cfg.get("return_params", True):
        for module in runtime.modules:  # collective for DTensors: every rank of a stage's (dp, tp) slice gathers
            params.update({k: v.tolist() for k, v in full_parameters(module).items()})
    return {"layout": layout, "params": params}


def average_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """all_reduce(SUM) each gradient over ``group``, then / its size (kernels.data_parallel_naive's way).

    A TP DTensor gradient is reduced shard by shard: the dp ranks at one tp index
    hold the same shard. Outside grad mode ``to_local()`` is the shard itself, so
    the in-place all_reduce updates the DTensor.
    """
    n = dist.get_world_size(group)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=group)
                grad /= n
