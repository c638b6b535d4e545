"""The rank function that trains the GPT under any layout: ``train_rank(cfg) -> records``.

Algorithm: synchronous minibatch AdamW on a 3D (pp, dp, tp) mesh, composed the way
torchtitan composes it (Megatron TP: Shoeybi et al., 2019; ZeRO: Rajbhandari et al.,
2020; PyTorch FSDP: Zhao et al., 2023; activation recomputation: Chen et al., 2016;
pipeline schedules: ``kernels.parallel.pipeline``). The run config (a
``kernels.run_config.RunConfig`` as a plain dict) resolves to one frozen ``Strategy``
(``kernels.parallel.strategy``); ``kernels.parallel.parallelize.parallelize`` applies it
(TP -> AC -> FSDP or DDP) to the whole model, or with pp > 1 to each pipeline stage;
``kernels.train_loop.train_loop`` runs the steps with the step function the strategy
picks. ``world_size`` (default: every rank) trains on the first world_size ranks
only; the others join the mesh's group creation and return an idle record.

Records: losses and grad_norms (global, the same on every rank), step_times (this
rank's), layout (coords, strategy, per-parameter global/local shapes and
placements; with pp also dp_strategy, schedule, stage_ids and stage_layers) and
params (this rank's parameters gathered whole, by name: every parameter, or with pp
its stages'); with measure, measure (``kernels.measure``'s record); with trace (pp
only), trace (``kernels.step_hooks.PipelineTracer``'s record); with watch_collectives or
faults, waits (``kernels.collective_log.StepWait`` dicts, from ``kernels.rank_watch``).

Run alone (prints the strategy the options resolve to, then the losses beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train --dp 2 --tp 2 --zero 3
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kernels import layout_rules, runtime
from kernels.batches import BatchStream
from kernels.measure import PipelineProbe, measure_record, step_probe
from kernels.data import dataset
from kernels.model import build_gpt, loss_fn, model_config
from kernels.parallel import pipeline
from kernels.parallel.ddp import unwrap
from kernels.parallel.fsdp import describe_params, full_parameters
from kernels.parallel.mesh import (ParallelDims, build_hsdp_mesh, build_mesh, destroy_mesh_groups, dp_group,
                                   dp_rank, pp_group, pp_rank)
from kernels.parallel.parallelize import parallelize
from kernels.parallel.strategy import GradSync, Strategy, run_strategy
from kernels.parallel.zero1 import build_zero1_optimizer, owned_parameters
from kernels.progress import reporter_for
from kernels.rank_watch import RankWatch
from kernels.reference import train_reference
from kernels.run_checkpoints import RunCheckpoints, settle_ddp_buckets
from kernels.run_config import RunConfig
from kernels.step_hooks import PipelineTracer, StepHooks
from kernels.train_loop import FlatStep, PipelineStep, train_loop


def dims_and_strategy(run: RunConfig, world_size: int) -> tuple[ParallelDims, Strategy]:
    """The mesh sizes and the Strategy ``run`` means on ``world_size`` ranks of the process group."""
    if dist.is_initialized() and world_size > dist.get_world_size():
        raise ValueError(f"world_size={world_size} is more than the {dist.get_world_size()} ranks of the process group")
    return run_strategy(run, world_size)


def _optimizer(model: nn.Module, strategy: Strategy, mesh, run: RunConfig, device: torch.device):
    # A CPU-offloaded FSDP2 model steps its optimizer on the CPU shards.
    kwargs = run.adamw_kwargs("cpu" if strategy.cpu_offload else device.type)
    if strategy.grad_sync is GradSync.ZERO1:
        return build_zero1_optimizer(model, mesh["dp"], **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def _train_flat(run: RunConfig, dims: ParallelDims, strategy: Strategy, mesh, dp_mesh, device,
                watch: RankWatch | None = None) -> dict[str, Any]:
    """pp == 1: the whole model, parallelized once; returns the records."""
    model = parallelize(build_gpt(model_config(run), device=device), strategy, mesh, dp_mesh)
    inner = unwrap(model)
    optimizer = _optimizer(inner, strategy, mesh, run, device)
    ckpt = RunCheckpoints(run, inner, optimizer, strategy)
    first = ckpt.resume()
    probe = step_probe(model, optimizer, device) if run.measure else None
    if watch is not None:
        watch.attach([model], optimizer)
    step_fn = FlatStep(model, strategy.microbatches, strategy.loss_parallel, device)
    losses, times, norms = _loop(run, dims, mesh, step_fn, optimizer, StepHooks(run.steps - first, probe), device,
                                 ckpt, watch)
    rank = dist.get_rank()
    layout = {"rank": rank, "coords": dims.coords(rank), "strategy": strategy.kind, "zero": strategy.zero,
              "hybrid": strategy.hybrid, "params": describe_params(inner)}
    if strategy.grad_sync is GradSync.ZERO1:
        layout["optimizer_params"] = owned_parameters(optimizer, inner)
    # full_parameters is collective for DTensors: every rank gathers, or none does.
    params = {k: v.tolist() for k, v in full_parameters(inner).items()} if run.return_params else {}
    out = {"losses": losses, "grad_norms": norms, "step_times": times, "layout": layout, "params": params,
           **ckpt.record()}
    if probe is not None:  # the measured record beside the layout it measured
        out["measure"] = measure_record(layout, dims, device, probe, loss=losses[-1],
                                        microbatches=strategy.microbatches, **activation_sizes(run, dims, strategy))
    return out


def activation_sizes(run: RunConfig, dims: ParallelDims, strategy: Strategy) -> dict[str, Any]:
    """What ``kernels.activation_rules`` needs to predict the measured activations by part: the model's sizes,
    the micro-batch and the flags that change what is saved."""
    return {"model": dataclasses.asdict(model_config(run)),
            "micro_batch": run.global_batch // (dims.dp * strategy.microbatches),
            "activation_checkpointing": run.activation_checkpointing, "mixed_precision": run.mixed_precision,
            "sequence_parallel": run.sequence_parallel}


def _train_pipeline(run: RunConfig, dims: ParallelDims, strategy: Strategy, mesh, dp_mesh, device,
                    watch: RankWatch | None = None) -> dict[str, Any]:
    """pp > 1: this rank's stages, each parallelized by the pipeline's model_transform hook; returns the records."""
    transform = functools.partial(parallelize, strategy=strategy, mesh=mesh, dp_mesh=dp_mesh)
    runtime = pipeline.build_pipeline(model_config(run), strategy.schedule, pp_rank(mesh), dims.pp,
                                      strategy.stages_per_rank, strategy.microbatches, pp_group(mesh), device,
                                      loss_fn, model_transform=transform)
    stack = nn.ModuleList(runtime.modules)  # this rank's stages as one module, for the optimizer and norms
    optimizer = _optimizer(stack, strategy, mesh, run, device)
    ckpt = RunCheckpoints(run, stack, optimizer, strategy)
    first = ckpt.resume()
    probe = PipelineProbe(stack, optimizer, device, runtime.stages) if run.measure else None
    tracer = PipelineTracer(run, runtime, device, stack, optimizer) if run.trace else None
    if watch is not None:
        watch.attach(list(runtime.modules), optimizer, list(runtime.stage_ids))
    by_hand = strategy.grad_sync in (GradSync.ALLREDUCE, GradSync.ZERO1) and dims.dp > 1
    step_fn = PipelineStep(runtime, stack, dp_group(mesh) if by_hand else None, pp_group(mesh), device)
    losses, times, norms = _loop(run, dims, mesh, step_fn, optimizer, StepHooks(run.steps - first, probe, tracer),
                                 device, ckpt, watch)
    out = {"losses": losses, "grad_norms": norms, "step_times": times, **ckpt.record(),
           **_pipeline_records(run, dims, runtime, strategy, optimizer)}
    if probe is not None:  # kernels.measure's record: the dp strategy, the schedule's sizes
        out["measure"] = measure_record(out["layout"], dims, device, probe, strategy=strategy.kind, loss=losses[-1],
                                        num_stages=runtime.num_stages, microbatches=runtime.num_microbatches,
                                        micro_batch=run.global_batch // (dims.dp * runtime.num_microbatches))
    if tracer is not None:
        out["trace"] = tracer.record(pp_rank(mesh), dp_rank(mesh), dims.dp, dims.pp)
    return out


def _loop(run: RunConfig, dims: ParallelDims, mesh, step_fn, optimizer, hooks: StepHooks, device: torch.device,
          ckpt: RunCheckpoints, watch: RankWatch | None = None):
    batches = BatchStream(dataset(run), steps=run.steps, global_batch=run.global_batch, dp_rank=dp_rank(mesh),
                          dp=dims.dp, device=device, first_step=ckpt.first_step)
    if ckpt.first_step:
        settle_ddp_buckets(step_fn, batches, optimizer)
    watched = watch.batches(batches) if watch is not None else batches
    progress = reporter_for(run.steps - ckpt.first_step, run.global_batch * model_config(run).seq_len, device,
                            step_fn, run.world_size, watch.log.step_wait_so_far if watch is not None else None) \
        if run.progress else None
    with progress or contextlib.nullcontext():
        out = train_loop(step_fn, optimizer, watched, dp=dims.dp, dp_group=dp_group(mesh), hooks=hooks,
                         record_grad_norm=run.record_grad_norm, on_step=ckpt.after_step, progress=progress)
    ckpt.close()  # an asynchronous save still in flight is named before the run returns
    return out


def _pipeline_records(run: RunConfig, dims: ParallelDims, runtime, strategy: Strategy, optimizer) -> dict[str, Any]:
    """The layout record (stages, their layers, per-parameter shapes) and the whole parameters of this rank's stages."""
    rank, layers = dist.get_rank(), model_config(run).layers
    layout = {"rank": rank, "coords": dims.coords(rank), "strategy": f"pp-{runtime.schedule_name}",
              "dp_strategy": strategy.kind, "zero": strategy.zero, "hybrid": strategy.hybrid,
              "schedule": runtime.schedule_name, "stage_ids": list(runtime.stage_ids),
              "stage_layers": {str(s): list(layout_rules.layer_split(layers, runtime.num_stages, s))
                               for s in runtime.stage_ids},
              "params": {k: v for module in runtime.modules for k, v in describe_params(module).items()}}
    if strategy.grad_sync is GradSync.ZERO1:  # ModuleList names are "<index>.<parameter name>"
        layout["optimizer_params"] = [n.split(".", 1)[1] for n in
                                      owned_parameters(optimizer, nn.ModuleList(runtime.modules))]
    params = {}
    if run.return_params:
        for module in runtime.modules:  # collective for DTensors: every rank of a stage's (dp, tp) slice gathers
            params.update({k: v.tolist() for k, v in full_parameters(module).items()})
    return {"layout": layout, "params": params}


def train_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train under the layout ``cfg`` (``RunConfig.to_dict()``) names; returns plain records (module docstring).

    Runs on every rank of the default process group; creates and destroys its own
    mesh sub-groups and frees the run's objects before it returns, so runs on a warm
    pool leave only the default group behind and memory does not creep.
    """
    run = RunConfig.from_dict(cfg)
    dims, strategy = dims_and_strategy(run, run.world_size or dist.get_world_size())
    device = runtime.rank_device()
    if device.type == "cuda":  # TF32 matmuls for what runs in fp32, as torch users set it on Ampere and later
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # Group creation is collective over every rank of the process group, in the mesh or not.
    mesh = build_mesh(dims, device.type)
    dp_mesh = build_hsdp_mesh(dims, device.type) if strategy.hybrid else None
    try:
        if mesh.get_coordinate() is None:  # beyond world_size: no part in this run
            return {"losses": [], "grad_norms": [], "step_times": [], "params": {},
                    "layout": {"rank": dist.get_rank(), "strategy": "idle"}}
        train = _train_pipeline if dims.pp > 1 else _train_flat
        if not (run.watch_collectives or run.faults):
            return train(run, dims, strategy, mesh, dp_mesh, device)
        synthetic = run.synthetic_forward_s if dims.pp == 1 else None  # with pp the tracer pads actions
        watch = RankWatch([mesh, dp_mesh], run.faults, synthetic)
        with watch.patched():
            out = train(run, dims, strategy, mesh, dp_mesh, device, watch)
            out["waits"] = [w.to_dict() for w in watch.finish()]
        return out
    finally:
        destroy_mesh_groups(mesh, dp_mesh)
        # The run's model, optimizer and DTensors sit in reference cycles (module hooks,
        # autograd graphs) that only Python's rare full collection frees: on a warm pool
        # each run's memory would pile up for dozens of runs first.
        gc.collect()


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The torchrun CLI's RunConfig."""
    p = argparse.ArgumentParser(description="Train the tiny GPT under one layout (run under torchrun).")
    for name, default in (("dp", 1), ("tp", 1), ("pp", 1), ("zero", 0), ("microbatches", 1), ("steps", 3),
                          ("global-batch", 8), ("layers", 2), ("d-model", 32), ("heads", 4), ("d-ff", 64),
                          ("vocab", 64), ("seq-len", 16), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--schedule", default="1f1b", help=f"pipeline schedule (pp > 1): {', '.join(layout_rules.SCHEDULES)}")
    p.add_argument("--stages-per-rank", type=int, help="pipeline stages per rank (default: the schedule's)")
    p.add_argument("--dp-replicate", type=int, help="HSDP replica groups (default: kernels.layout_rules.hsdp_split)")
    p.add_argument("--fsdp-strategy", choices=tuple(layout_rules.FSDP_STRATEGY_ZERO))
    p.add_argument("--mixed-precision", choices=("bf16",))
    p.add_argument("--synthetic-forward-s", type=float, help="with --trace: pad every action to this cost")
    for flag in ("sequence-parallel", "loss-parallel", "activation-checkpointing", "cpu-offload", "compile", "trace"):
        p.add_argument(f"--{flag}", action="store_true")
    a = vars(p.parse_args(argv))
    model = {k: a.pop(k) for k in ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len")}
    return RunConfig(model=model, return_params=False, **a)


def main(argv: list[str] | None = None) -> None:
    run = parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    try:
        if dist.get_rank() == 0:  # what the options resolved to (zero 0 with dp x tp is FSDP2, for one)
            strategy = dims_and_strategy(run, run.world_size or dist.get_world_size())[1]
            print(strategy.describe(), flush=True)
        out = train_rank(run.to_dict())
        if dist.get_rank() == 0:
            ref = train_reference(run)["losses"]
            for step, (mine, theirs) in enumerate(zip(out["losses"], ref)):
                print(f"step {step}: loss {mine:.6f}  reference {theirs:.6f}  ({out['step_times'][step]*1e3:.1f} ms)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
