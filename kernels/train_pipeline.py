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
over the pipeline's stages the same way (after the optimizer step, which leaves .grad alone).

Measuring the last step (both off by default; then nothing is installed and the loop
costs what it did):

- ``cfg["trace"]``: after the untraced steps (the first also infers p2p shapes), the
  clocks are aligned to rank 0 (``kernels.trace.align_clocks``), the ranks meet at a
  barrier, and the step runs inside ``kernels.trace.traced``: per-stage F/B/I/W and
  p2p waits, plus spans for the dp gradient all-reduce and the optimizer step
  (GPipe: Huang et al., 2019; 1F1B: Narayanan et al., 2019). ``synthetic_forward_s``
  pads every action to a fixed cost (``kernels.synthetic.SyntheticCost``, v = this
  rank's stage count) so the bubble is comparable with theory; real compute with more
  ranks on a host (``ranks_per_host[rank]``) than cores carries a warning.
- ``cfg["measure"]``: ``kernels.measure.PipelineProbe`` meters the step's collectives
  and stage sends and takes memory at rest. Its meter waits for each collective at
  once, so an FSDP stage's overlap is serialised when both are on.

Run alone (PP 2 x DP 2 with the ZBV schedule, beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train --pp 2 --dp 2 --schedule zbv --layers 4 --microbatches 4
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kernels import pipeline
from kernels.data import shard_batch
from kernels.fsdp import describe_params, full_parameters
from kernels.measure import PipelineProbe, measure_record
from kernels.mesh import ParallelDims, dp_group, dp_rank, pp_group, pp_rank
from kernels.model import loss_fn, stage_layers
from kernels.pipeline_trace import planned_compute_order
from kernels.reference import adamw_kwargs, dataset, model_config, run_settings
from kernels.synthetic import SyntheticCost, oversubscription_warning
from kernels.trace import TraceRecorder, align_clocks, traced
from kernels.train import grad_norm, layout_plan, parallelize
from kernels.zero import apply_zero1, owned_parameters


def train_pipeline(cfg: dict[str, Any], dims: ParallelDims, mesh, device: torch.device, dp_mesh=None) -> dict[str, Any]:
    """pp > 1: kernels.pipeline's stages, each parallelized (TP -> AC -> FSDP) by its model_transform hook."""
    plan, settings, data = layout_plan(cfg, dims), run_settings(cfg), dataset(cfg)
    schedule = cfg.get("schedule", "1f1b")
    stages = int(cfg.get("virtual_stages") or (1 if schedule in pipeline.SINGLE_STAGE else 2))
    transform = functools.partial(parallelize, cfg=cfg, dims=dims, mesh=mesh, plan=plan, dp_mesh=dp_mesh)
    runtime = pipeline.build_pipeline(model_config(cfg), schedule, pp_rank(mesh), dims.pp, stages,
                                      int(cfg.get("microbatches") or dims.pp), pp_group(mesh), device, loss_fn,
                                      model_transform=transform)
    stack = nn.ModuleList(runtime.modules)  # this rank's stages as one module, for the optimizer and norms
    optimizer = (apply_zero1(stack, dims, mesh, **adamw_kwargs(settings)) if plan["kind"] == "zero1"
                 else torch.optim.AdamW(stack.parameters(), **adamw_kwargs(settings)))
    probe = PipelineProbe(stack, optimizer, device, runtime.stages) if cfg.get("measure") else None
    tracer = _Tracer(cfg, runtime, device) if cfg.get("trace") else None
    losses, times, norms = [], [], []
    for step in range(settings["steps"]):
        last = step == settings["steps"] - 1
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T) each
        inputs, targets = shard_batch(inputs, targets, dp_rank(mesh), dims.dp)  # (B/dp, T)
        rec = tracer.begin(step) if tracer and last else None  # clocks aligned, ranks met
        start = time.perf_counter()
        with probe.step() if probe and last else contextlib.nullcontext():
            with traced(runtime.stages, rec, tracer.synthetic) if rec else contextlib.nullcontext():
                loss = pipeline.pipeline_step(runtime, inputs, targets)  # float on the last stage, else None
            if plan["kind"] in ("allreduce", "zero1") and dims.dp > 1:
                with _span(rec, "all_reduce", nbytes=_grad_bytes(stack)):
                    average_gradients(stack, dp_group(mesh))
            with _span(rec, "optimizer"):
                optimizer.step()
        if probe and last:
            probe.at_rest()
        if cfg.get("record_grad_norm", True):  # this rank's stages, then summed in squares over the pipeline
            sq = torch.tensor(grad_norm(stack) ** 2, dtype=torch.float64, device=device)
            dist.all_reduce(sq, group=pp_group(mesh))
            norms.append(sq.item() ** 0.5)
        optimizer.zero_grad(set_to_none=probe is None)  # probing: gradient buffers live across steps
        times.append(time.perf_counter() - start)
        # Reporting only: the replica's loss from its last stage to every pp rank, then the mean over dp.
        total = pipeline.share_loss(loss, pp_group(mesh), device)
        dist.all_reduce(total, group=dp_group(mesh))
        losses.append(total.item() / dims.dp)
    out = {"losses": losses, "grad_norms": norms, "step_times": times,
           **_pipeline_records(cfg, dims, runtime, plan, optimizer)}
    if probe is not None:  # kernels.measure's record: the dp strategy, the schedule's sizes
        out["measure"] = measure_record(out["layout"], dims, device, probe, strategy=plan["kind"], loss=losses[-1],
                                        num_stages=runtime.num_stages, microbatches=runtime.num_microbatches,
                                        micro_batch=settings["global_batch"] // (dims.dp * runtime.num_microbatches))
    if tracer is not None:
        out["trace"] = tracer.record(pp_rank(mesh), dims)
    return out


class _Tracer:
    """The last step's recorder, synthetic cost and clock sync; ``record`` is the plain trace record."""

    def __init__(self, cfg: dict[str, Any], runtime, device: torch.device) -> None:
        self.runtime, self.device, self.rounds = runtime, device, int(cfg.get("align_rounds", 4))
        forward_s = cfg.get("synthetic_forward_s")
        self.synthetic = SyntheticCost(float(forward_s), len(runtime.stage_ids)) if forward_s else None
        rank, per_host = dist.get_rank(), cfg.get("ranks_per_host")
        if int(cfg.get("world_size") or dist.get_world_size()) != dist.get_world_size():
            raise ValueError("trace aligns clocks over every rank of the process group: run on all of them")
        here = per_host[rank] if per_host else int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.warning = oversubscription_warning(here, self.synthetic is not None)
        # Synthetic actions sleep on the CPU clock, so their events are timed on it too.
        self.rec = TraceRecorder(rank, device, cpu_clock=self.synthetic is not None)
        self.sync: dict | None = None

    def begin(self, step: int) -> TraceRecorder:
        """Align the clocks (every rank of the default group), then start the step together."""
        self.sync = align_clocks(self.rounds, self.device)
        self.rec.step = step
        dist.barrier()
        return self.rec

    def record(self, pp_rank_: int, dims: ParallelDims) -> dict[str, Any]:
        r = self.runtime
        return {"rank": dist.get_rank(), "pp_rank": pp_rank_, "schedule": r.schedule_name, "pp": dims.pp,
                "dp": dims.dp, "stages_per_rank": len(r.stage_ids), "microbatches": r.num_microbatches,
                "stage_ids": list(r.stage_ids), "num_stages": r.num_stages, "device": str(self.device),
                "synthetic": self.synthetic is not None,
                "synthetic_cost": self.synthetic.summary() if self.synthetic else None,
                "events": self.rec.events(self.sync), "clock": self.sync,
                "planned": planned_compute_order(r, pp_rank_), "warnings": [self.warning] if self.warning else []}


def _span(rec: TraceRecorder | None, kind: str, **extra: Any):
    """``rec.span(kind)`` when tracing, else nothing."""
    return rec.span(kind, **extra) if rec is not None else contextlib.nullcontext()


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of this rank's local gradients: what ``average_gradients`` all-reduces."""
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in model.parameters())
             if g is not None]
    return sum(g.numel() * g.element_size() for g in grads)


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
