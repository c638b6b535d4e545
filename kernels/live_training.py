"""A training held on the ranks between calls: the model, its optimizer and the data position stay alive.

``kernels.train.train_rank`` builds a layout, trains and frees everything in one call.
Here the same build (``kernels.parallel.parallelize`` on a ``(pp, dp, tp)`` mesh, or
``kernels.parallel.pipeline`` stages) is kept in a per-rank registry under a key the
driver chose, so a later call continues where the last one stopped:

- ``open_training(key, cfg)`` builds the layout ``cfg`` (a ``RunConfig`` dict) names;
- ``advance(key, steps)`` runs ``kernels.train_loop.train_loop`` over the next ``steps``
  global batches (batch ``s`` of the data stream is step ``s`` of the run, whoever trains
  it), so two calls of 3 steps are the same computation as one run of 6; with the run's
  ``checkpoint_dir`` it saves as ``train_rank`` does (``kernels.checkpoint``);
- ``close_training(key)`` destroys the mesh's groups and frees the objects.

A held training lives inside one world: every mesh sub-group it holds belongs to the
process group of the world it was built in. So ``kernels.runtime.leave_world`` (a
failure, a world rebuild, a pool stop) closes every held training first; a later
``advance`` on its key then says the training is gone instead of using dead groups.

Run alone (4 ranks: 2 + 2 steps equal 4 steps of ``train_rank``)::

    torchrun --nproc-per-node 4 -m kernels.live_training
"""
from __future__ import annotations

import dataclasses
import functools
import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kernels import runtime
from kernels.batches import BatchStream
from kernels.checkpoint import load_checkpoint, save_checkpoint
from kernels.checkpoint_files import read_meta, step_dir
from kernels.data import dataset
from kernels.measure import PipelineProbe, StepProbe, measure_record, step_probe
from kernels.model import build_gpt, loss_fn, model_config
from kernels.parallel import pipeline
from kernels.parallel.ddp import unwrap
from kernels.parallel.fsdp import describe_params, full_parameters
from kernels.parallel.mesh import (build_hsdp_mesh, build_mesh, destroy_mesh_groups, dp_group, dp_rank, pp_group,
                                   pp_rank)
from kernels.parallel.parallelize import parallelize
from kernels.parallel.strategy import GradSync
from kernels.parallel.zero1 import owned_parameters
from kernels.run_checkpoints import settle_ddp_buckets
from kernels.run_config import RunConfig
from kernels.step_hooks import PipelineTracer, StepHooks
from kernels.train import _optimizer, _pipeline_records, dims_and_strategy
from kernels.train_loop import FlatStep, PipelineStep, train_loop


class TrainingGoneError(RuntimeError):
    """The key names no training on this rank (never opened, closed, or closed with the world it lived in)."""


class LiveTraining:
    """One rank's part of a held training: the parallelized model, the optimizer, the next step and the losses."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.dims, self.strategy = dims_and_strategy(run, run.world_size or dist.get_world_size())
        self.device = runtime.rank_device()
        self.mesh = build_mesh(self.dims, self.device.type)  # collective over every rank of the world
        self.dp_mesh = build_hsdp_mesh(self.dims, self.device.type) if self.strategy.hybrid else None
        self.next_step, self.losses = 0, []
        self.idle = self.mesh.get_coordinate() is None  # beyond the layout's world size: holds nothing
        # The ranks of the layout, for checkpoints (None: the whole world). Collective: every rank creates it.
        size = self.dims.world_size
        self.group = dist.new_group(list(range(size))) if size < dist.get_world_size() else None
        self.pipe = None
        if self.idle:
            return
        if self.dims.pp > 1:
            self._build_pipeline()
        else:
            self._build_flat()

    def _build_flat(self) -> None:
        self.model = parallelize(build_gpt(model_config(self.run), device=self.device), self.strategy, self.mesh,
                                 self.dp_mesh)
        self.params_module = unwrap(self.model)
        self.optimizer = _optimizer(self.params_module, self.strategy, self.mesh, self.run, self.device)
        if self.run.measure:  # reroutes DDP's buckets through Python once, before the first backward
            step_probe(self.model, self.optimizer, self.device)
        self.step_fn = FlatStep(self.model, self.strategy.microbatches, self.strategy.loss_parallel, self.device)

    def _build_pipeline(self) -> None:
        run, dims, strategy, mesh = self.run, self.dims, self.strategy, self.mesh
        transform = functools.partial(parallelize, strategy=strategy, mesh=mesh, dp_mesh=self.dp_mesh)
        self.pipe = pipeline.build_pipeline(model_config(run), strategy.schedule, pp_rank(mesh), dims.pp,
                                            strategy.stages_per_rank, strategy.microbatches, pp_group(mesh),
                                            self.device, loss_fn, model_transform=transform)
        self.params_module = nn.ModuleList(self.pipe.modules)  # this rank's stages, for the optimizer and norms
        self.optimizer = _optimizer(self.params_module, strategy, mesh, run, self.device)
        by_hand = strategy.grad_sync in (GradSync.ALLREDUCE, GradSync.ZERO1) and dims.dp > 1
        self.step_fn = PipelineStep(self.pipe, self.params_module, dp_group(mesh) if by_hand else None,
                                    pp_group(mesh), self.device)

    def stage_modules(self) -> list[nn.Module]:
        """The modules whose parameters carry GPT's own names: the whole model, or this rank's stages."""
        return [] if self.idle else list(self.pipe.modules) if self.pipe else [self.params_module]

    def advance(self, steps: int, *, return_params: bool = False) -> dict[str, Any]:
        """Train the next ``steps`` steps; returns ``train_rank``'s records for them, plus ``first_step``.

        With the run's ``checkpoint_dir``, a checkpoint is saved after every global step that is
        a multiple of ``checkpoint_every`` and after the last step (``step_NNNNNN`` under it).
        Measuring acts on the last step, as in an Experiment's run.
        """
        first = self.next_step
        if self.idle:  # keeps count, so that it stands at the right step if a later layout gives it a part
            self.next_step += steps
            return {"losses": [], "grad_norms": [], "step_times": [], "params": {}, "first_step": first,
                    "layout": {"rank": dist.get_rank(), "strategy": "idle"}}
        probe, tracer = self._probes()
        losses, times, norms = [], [], []
        checkpoint_dir = self.run.checkpoint_dir
        for chunk in save_points(first, steps, self.run.checkpoint_every if checkpoint_dir else None):
            hooks = StepHooks(chunk, probe, tracer) if len(losses) + chunk == steps else StepHooks(chunk)
            part = train_loop(self.step_fn, self.optimizer, self._batches(chunk), dp=self.dims.dp,
                              dp_group=dp_group(self.mesh),
                              hooks=hooks, record_grad_norm=self.run.record_grad_norm)
            losses, times, norms = losses + part[0], times + part[1], norms + part[2]
            self.next_step += chunk
            self.losses += part[0]
            if checkpoint_dir is not None:
                self.save(str(step_dir(checkpoint_dir, self.next_step)), {})
        out = {"losses": losses, "grad_norms": norms, "step_times": times, "first_step": first,
               **self._records(return_params)}
        if probe is not None:
            out["measure"] = self._measure_record(out["layout"], probe, losses[-1])
        if tracer is not None:
            out["trace"] = tracer.record(pp_rank(self.mesh), dp_rank(self.mesh), self.dims.dp, self.dims.pp)
        return out

    def _probes(self) -> tuple[StepProbe | None, PipelineTracer | None]:
        probe = tracer = None
        if self.run.measure:
            probe = PipelineProbe(self.params_module, self.optimizer, self.device, self.pipe.stages) if self.pipe \
                else StepProbe(self.model, self.optimizer, self.device)
        if self.run.trace and self.pipe:
            tracer = PipelineTracer(self.run, self.pipe, self.device, self.params_module, self.optimizer)
        return probe, tracer

    def _records(self, return_params: bool) -> dict[str, Any]:
        """The layout record and, when asked, the whole parameters (a collective for DTensors)."""
        if self.pipe:
            return _pipeline_records(dataclasses.replace(self.run, return_params=return_params), self.dims, self.pipe,
                                     self.strategy, self.optimizer)
        rank, strategy = dist.get_rank(), self.strategy
        layout = {"rank": rank, "coords": self.dims.coords(rank), "strategy": strategy.kind, "zero": strategy.zero,
                  "hybrid": strategy.hybrid, "params": describe_params(self.params_module)}
        if strategy.grad_sync is GradSync.ZERO1:
            layout["optimizer_params"] = owned_parameters(self.optimizer, self.params_module)
        params = {k: v.tolist() for k, v in full_parameters(self.params_module).items()} if return_params else {}
        return {"layout": layout, "params": params}

    def _measure_record(self, layout: dict[str, Any], probe: StepProbe, loss: float) -> dict[str, Any]:
        if not self.pipe:
            return measure_record(layout, self.dims, self.device, probe, loss=loss,
                                  microbatches=self.strategy.microbatches)
        return measure_record(layout, self.dims, self.device, probe, strategy=self.strategy.kind, loss=loss,
                              num_stages=self.pipe.num_stages, microbatches=self.pipe.num_microbatches,
                              micro_batch=self.run.global_batch // (self.dims.dp * self.pipe.num_microbatches))

    def save(self, path: str, meta: dict[str, Any]) -> None:
        """Write the model and optimizer to the step directory ``path`` (``kernels.checkpoint``), where the run stands."""
        if not self.idle:
            strategy = self.strategy  # the meta of kernels.run_checkpoints, and every loss so far
            layout = {"pp": strategy.pp, "dp": strategy.dp, "tp": strategy.tp, "zero": strategy.zero,
                      "schedule": strategy.schedule, "describe": strategy.describe()}
            save_checkpoint(path, self.params_module, self.optimizer,
                            {**meta, "step": self.next_step, "data_step": self.next_step, "losses": self.losses,
                             "loss": self.losses[-1] if self.losses else None, "config": self.run.to_dict(),
                             "world_size": self.dims.world_size, "layout": layout}, process_group=self.group)

    def load(self, path: str) -> dict[str, Any]:
        """Read the model and optimizer from ``path`` into this layout, and stand where it was saved; returns its meta."""
        if self.idle:
            meta = read_meta(path)
            self.next_step, self.losses = int(meta["step"]), list(meta.get("losses", []))
            return meta
        meta = load_checkpoint(path, self.params_module, self.optimizer, process_group=self.group)
        self.next_step, self.losses = int(meta["step"]), list(meta.get("losses", []))
        settle_ddp_buckets(self.step_fn, self._batches(1), self.optimizer)  # DDP's rebuilt buckets, as if never stopped
        return meta

    def _batches(self, steps: int) -> BatchStream:
        """This rank's share of the next ``steps`` global batches."""
        return BatchStream(dataset(self.run), steps=self.next_step + steps, first_step=self.next_step,
                           global_batch=self.run.global_batch, dp_rank=dp_rank(self.mesh), dp=self.dims.dp,
                           device=self.device)

    def close(self) -> None:
        """Destroy this training's groups and drop its objects (their reference cycles collected)."""
        destroy_mesh_groups(self.mesh, self.dp_mesh)
        if self.group is not None:
            dist.destroy_process_group(self.group)
        for name in ("model", "params_module", "optimizer", "step_fn", "pipe", "mesh", "dp_mesh", "group"):
            self.__dict__.pop(name, None)
        gc.collect()


_held: dict[str, LiveTraining] = {}


def open_training(key: str, cfg: dict[str, Any], *, next_step: int = 0, losses: list[float] | None = None) -> int:
    """Build the layout ``cfg`` names and hold it under ``key`` (closing any training held there); returns the rank.

    ``next_step`` and ``losses`` say where the run stands (a training rebuilt under a new layout goes on from there).
    """
    close_training(key)
    live = LiveTraining(RunConfig.from_dict(cfg))
    live.next_step, live.losses = next_step, list(losses or [])
    _held[key] = live
    return dist.get_rank()


def held(key: str) -> LiveTraining:
    """The training held under ``key``; ``TrainingGoneError`` when there is none."""
    live = _held.get(key)
    if live is None:
        raise TrainingGoneError(f"no training is held under {key!r} on this rank: it was closed, or the world "
                                "it lived in was rebuilt (after a failure or a restart)")
    return live


def save_points(first: int, steps: int, every: int | None) -> list[int]:
    """The steps from ``first`` on, in runs that end at each multiple of ``every`` and at the last one."""
    if every is None:
        return [steps]
    out, at, end = [], first, first + steps
    while at < end:
        stop = min(end, (at // every + 1) * every)
        out.append(stop - at)
        at = stop
    return out


def advance(key: str, steps: int, *, return_params: bool = False) -> dict[str, Any]:
    """Train the held training ``steps`` more steps; returns their records (``LiveTraining.advance``)."""
    return held(key).advance(steps, return_params=return_params)


def save_training(key: str, path: str, meta: dict[str, Any] | None = None) -> int:
    """Save the training held under ``key`` to the step directory ``path``; returns the step saved."""
    live = held(key)
    live.save(path, meta or {})
    return live.next_step


def load_training(key: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Build the layout ``cfg`` names under ``key`` and load the checkpoint ``path`` into it; returns its meta."""
    open_training(key, cfg)
    return held(key).load(path)


def relayout_training(key: str, cfg: dict[str, Any], through: str) -> int:
    """Move the training held under ``key`` to the layout ``cfg`` names, weights and optimizer state included.

    The old layout writes its state to the step directory ``through`` with DCP, the new
    one is built and reads it back, each rank its own pieces (DCP plans the reads from the
    saved shards' offsets, so any layout or world size of the same model can load them).
    The old layout's groups are destroyed before the new mesh is made. Returns the step.
    """
    live = held(key)
    live.save(through, {})
    step, losses = live.next_step, live.losses
    open_training(key, cfg, next_step=step, losses=losses)
    held(key).load(through)
    return step


def close_training(key: str) -> bool:
    """Close the training held under ``key``; True if there was one."""
    live = _held.pop(key, None)
    if live is None:
        return False
    live.close()
    return True


def close_all() -> int:
    """Close every held training (the world they live in is about to go); returns how many."""
    keys = list(_held)
    for key in keys:
        close_training(key)
    return len(keys)


def held_keys() -> list[str]:
    """The keys of the trainings this rank holds."""
    return sorted(_held)


runtime.on_leave_world(close_all)


def _main() -> None:
    from kernels.train import train_rank
    dist.init_process_group("gloo")
    try:
        cfg = RunConfig(model={"layers": 2}, dp=2, tp=2, steps=4, return_params=False).to_dict()
        open_training("demo", cfg)
        held_losses = advance("demo", 2)["losses"] + advance("demo", 2)["losses"]
        close_training("demo")
        whole = train_rank(cfg)["losses"]
        if dist.get_rank() == 0:
            print("2 + 2 held steps:", held_losses)
            print("4 steps at once: ", whole, "(equal)" if held_losses == whole else "(DIFFERENT)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
