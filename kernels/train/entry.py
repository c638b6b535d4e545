"""The rank function that trains the GPT under any layout: ``train_rank(cfg) -> records``.

Algorithm: synchronous minibatch AdamW on a 3D (pp, dp, tp) mesh, composed the way
torchtitan composes it (Megatron TP: Shoeybi et al., 2019; ZeRO: Rajbhandari et al.,
2020; PyTorch FSDP: Zhao et al., 2023; activation recomputation: Chen et al., 2016;
pipeline schedules: ``kernels.parallel.pipeline``). ``kernels.train.run_build.RankBuild``
builds this rank's part of the layout the run config (a ``kernels.contract.run_config.RunConfig``
as a plain dict) names: mesh, parallelized model or stages, optimizer, step function;
``kernels.train.train_loop.train_loop`` runs the steps with it. ``world_size`` (default:
every rank) trains on the first world_size ranks only; the others join the mesh's group
creation and return an idle record.

Records: losses and grad_norms (global, the same on every rank), step_times (this
rank's), lrs (each step's learning rate) and spikes (the steps a spike guard skipped,
``kernels.contract.training_hygiene.SpikeEvent`` dicts), layout (coords, strategy, per-parameter global/local shapes and
placements; with pp also dp_strategy, schedule, stage_ids and stage_layers) and
params (this rank's parameters gathered whole, by name: every parameter, or with pp
its stages'); with measure, measure (``kernels.train.measured_run``'s record); with trace (pp
only), trace (``kernels.train.step_hooks.PipelineTracer``'s record); with cp > 1, ring_steps (the last
step's ``kernels.contract.expert_context_records.RingStep`` dicts); with experts, routing_steps (every
step's ``kernels.contract.expert_context_records.RoutingStep`` dicts, one per MoE layer); with watch_collectives or
faults, waits (``kernels.watch.collective_log.StepWait`` dicts, from ``kernels.watch.rank_watch``).

Run alone (prints the strategy the options resolve to, then the losses beside the one-process reference;
with ``--measure``, rank 0's memory and communication in the last step)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 3
    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 4 --zero 3 --measure
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
from typing import Any

import torch
import torch.distributed as dist

from kernels.contract import layout_rules
from kernels.model.family import model_config
from kernels.parallel.mesh import dp_group
from kernels.watch.progress import reporter_for
from kernels.watch.rank_watch import RankWatch
from kernels.train.reference import train_reference
from kernels.train.run_build import RankBuild, dims_and_strategy
from kernels.train.run_checkpoints import RunCheckpoints, settle_ddp_buckets
from kernels.contract.run_config import RunConfig
from kernels.train.step_hooks import StepHooks
from kernels.train.train_loop import train_loop
from kernels.train.update_rules import UpdateRules


def _train(build: RankBuild, watch: RankWatch | None = None) -> dict[str, Any]:
    """Resume (when asked), train the run's steps and save as it goes; returns the records."""
    run = build.run
    everyone = dist.get_world_size()
    if (run.checkpoint_dir or run.resume_from) and (run.world_size or everyone) != everyone:
        raise ValueError("checkpoints are saved and loaded by every rank of the process group: run on all of them "
                         f"(world_size={run.world_size} of {everyone})")
    ckpt = RunCheckpoints(run, build.params_module, build.optimizer, build.strategy)
    first = ckpt.resume()
    probe, tracer = build.probes()
    if watch is not None:
        build.attach(watch)
    # The spike guard, clipping and lr schedule, from the step the run starts at; an async save's copy ends first.
    update = build.update_rules(ckpt.before_update)
    update.seek(first)
    hooks = StepHooks(run.steps - first, probe, tracer, build.ring_log)
    losses, times, norms = _loop(build, hooks, ckpt, update, watch)
    out = {"losses": losses, "grad_norms": norms, "step_times": times, **ckpt.record(),
           **build.records(run.return_params), **update.take()}
    if probe is not None:  # the measured record beside the layout it measured
        out["measure"] = build.measure_record(out["layout"], probe, losses[-1])
    if tracer is not None:
        out["trace"] = build.trace_record(tracer)
    if build.ring_log is not None:  # context parallelism: the last step's ring steps (RingStep dicts)
        out["ring_steps"] = build.ring_log.rows
    out.update(build.routing_records())  # a model with experts: each step's routing per MoE layer
    return out


def _loop(build: RankBuild, hooks: StepHooks, ckpt: RunCheckpoints, update: UpdateRules,
          watch: RankWatch | None = None):
    run = build.run
    batches = build.batches(ckpt.first_step, run.steps - ckpt.first_step)
    if ckpt.first_step:
        settle_ddp_buckets(build.step_fn, batches, build.optimizer)
        build.routing.discard()  # that forward trained no step
    watched = watch.batches(batches) if watch is not None else batches
    progress = reporter_for(run.steps - ckpt.first_step, run.global_batch * model_config(run).seq_len, build.device,
                            build.step_fn, run.world_size, watch.log.step_wait_so_far if watch is not None else None) \
        if run.progress else None
    with progress or contextlib.nullcontext():
        out = train_loop(build.step_fn, build.optimizer, watched, dp=build.dims.data, dp_group=dp_group(build.mesh),
                         hooks=hooks, record_grad_norm=run.record_grad_norm,
                         on_step=build.after_step(ckpt.first_step, ckpt.after_step), progress=progress, update=update)
    ckpt.close()  # an asynchronous save still in flight is named before the run returns
    return out


def train_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train under the layout ``cfg`` (``RunConfig.to_dict()``) names; returns plain records (module docstring).

    Runs on every rank of the default process group; its mesh comes from the meshes the pool keeps
    warm (``kernels.parallel.warm_meshes``: a bounded set, evicted with their groups destroyed), and it
    frees the run's objects before it returns, so memory does not creep on a warm pool.
    """
    run = RunConfig.from_options(cfg)
    build = RankBuild(run)  # group creation is collective over every rank of the process group, in the mesh or not
    try:
        if build.idle:  # beyond world_size: no part in this run
            return {"losses": [], "grad_norms": [], "step_times": [], "params": {},
                    "layout": {"rank": dist.get_rank(), "strategy": "idle"}}
        watch = build.watch()
        if watch is None:
            return _train(build)
        with watch.patched():
            out = _train(build, watch)
            out["waits"] = [w.to_dict() for w in watch.finish()]
        return out
    finally:
        build.close()
        del build
        # The run's model, optimizer and DTensors sit in reference cycles (module hooks,
        # autograd graphs) that only Python's rare full collection frees: on a warm pool
        # each run's memory would pile up for dozens of runs first.
        gc.collect()


def measure_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train the layout ``cfg`` names for ``cfg["steps"]`` (default 2) steps, probe the last; returns the record.

    ``train_rank`` with ``measure`` on: the record is ``kernels.train.measured_run``'s.
    """
    run = {**cfg, "measure": True, "trace": False, "return_params": False, "record_grad_norm": False,
           "steps": max(1, int(cfg.get("steps", 2)))}
    return train_rank(run)["measure"]


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The torchrun CLI's RunConfig."""
    p = argparse.ArgumentParser(description="Train the tiny GPT under one layout (run under torchrun).")
    for name, default in (("dp", 1), ("tp", 1), ("pp", 1), ("zero", 0), ("microbatches", None), ("steps", 3),
                          ("global-batch", 8), ("layers", 2), ("d-model", 32), ("heads", 4), ("d-ff", 64),
                          ("vocab", 64), ("seq-len", 16), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--schedule", default="1f1b", help=f"pipeline schedule (pp > 1): {', '.join(layout_rules.SCHEDULES)}")
    p.add_argument("--stages-per-rank", type=int, help="pipeline stages per rank (default: the schedule's)")
    p.add_argument("--stage-layers", type=int, nargs="+", help="blocks of each pipeline stage (default: equal)")
    p.add_argument("--dp-replicate", type=int, help="HSDP replica groups (default: kernels.contract.layout_rules.hsdp_split)")
    p.add_argument("--fsdp-strategy", choices=tuple(layout_rules.FSDP_STRATEGY_ZERO))
    p.add_argument("--mixed-precision", choices=("bf16",))
    p.add_argument("--synthetic-forward-s", type=float, help="with --trace: pad every action to this cost")
    p.add_argument("--checkpoint-dir", help="save after the last step (kernels.train.run_checkpoints)")
    p.add_argument("--resume-from", help="a checkpoint directory or step to resume from, under any layout")
    for flag in ("sequence-parallel", "loss-parallel", "cpu-offload", "compile", "trace", "measure"):
        p.add_argument(f"--{flag}", action="store_true")
    p.add_argument("--activation-checkpointing", nargs="?", const=True, default=False, choices=("selective",),
                   help="recompute each block in backward; 'selective': all but its matmuls")
    a = vars(p.parse_args(argv))
    model = {k: a.pop(k) for k in ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len")}
    return RunConfig.from_options({"model": model, "return_params": False, **a})


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
        ref = train_reference(run)["losses"]  # on every rank: a resume loads the checkpoint collectively (DCP)
        if dist.get_rank() == 0:
            for i, (mine, theirs) in enumerate(zip(out["losses"], ref)):
                print(f"step {out.get('first_step', 0) + i}: loss {mine:.6f}  reference {theirs:.6f}  "
                      f"({out['step_times'][i]*1e3:.1f} ms)")
            if run.measure:  # rank 0's memory and communication in the last step (kernels.train.measured_run)
                print(json.dumps({k: out["measure"][k] for k in ("strategy", "memory", "comm")}, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
