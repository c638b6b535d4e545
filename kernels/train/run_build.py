"""One rank's part of a layout, built once: mesh, parallelized model or pipeline stages, optimizer, step function.

The run config (a ``kernels.contract.run_config.RunConfig``) resolves to one frozen ``Strategy``
(``kernels.contract.strategy``); ``kernels.parallel.parallelize.parallelize`` applies it
(TP -> AC -> FSDP or DDP) to the whole model, or with pp > 1 to each pipeline stage
(``kernels.parallel.pipeline``). ``RankBuild`` holds what that yields, and the records
that describe it, for the two callers that train it: ``kernels.train.entry.train_rank`` (one
run, freed on return) and ``kernels.train.live_training`` (held between calls).

A rank beyond the layout's world size joins the mesh's group creation (collective over
the whole process group) and holds nothing: ``idle`` is true.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from kernels.contract import layout_rules
from kernels.contract.strategy import GradSync, Strategy
from kernels.engine import runtime
from kernels.engine.long_lived import freeze_long_lived
from kernels.train.batches import BatchStream
from kernels.train.data import dataset
from kernels.train.measured_run import PipelineProbe, StepProbe, measure_record, step_probe
from kernels.model.family import OwnConfig, build_model, model_config, model_loss
from kernels.model.moe_routing import RoutingLog
from kernels.train.optimizer import build_optimizer, optimizer_class
from kernels.parallel import meta_shape_propagation, pipeline
from kernels.parallel.ddp import unwrap
from kernels.parallel.fsdp import block_unit_names, describe_params, full_parameters
from kernels.parallel.context_parallel import RingLog
from kernels.parallel.expert_parallel import ExpertGradSync, expert_parameters
from kernels.parallel.mesh import (ParallelDims, build_cp_mesh, build_ep_mesh, build_hsdp_mesh, build_mesh,
                                   dp_group, dp_rank, pp_group, pp_rank)
from kernels.parallel.parallelize import parallelize
from kernels.parallel.warm_meshes import let_go, warm_mesh
from kernels.parallel.stage_shapes import stage_examples
from kernels.parallel.tied_stages import TiedGrads
from kernels.parallel.zero1 import build_zero1_optimizer, owned_parameters
from kernels.contract.run_config import RunConfig
from kernels.train.step_hooks import PipelineTracer
from kernels.train.poisoned_loss import poisoned
from kernels.train.train_loop import FlatStep, PipelineStep, average_gradients
from kernels.train.update_rules import UpdateRules, clip_to_norm
from kernels.watch.rank_watch import RankWatch


def dims_and_strategy(run: RunConfig, world_size: int) -> tuple[ParallelDims, Strategy]:
    """The mesh sizes of ``run``'s Strategy on ``world_size`` ranks of the process group, and the Strategy."""
    if dist.is_initialized() and world_size > dist.get_world_size():
        raise ValueError(f"world_size={world_size} is more than the {dist.get_world_size()} ranks of the process group")
    s = run.strategy
    return ParallelDims(dp=s.dp, tp=s.tp, pp=s.pp, world_size=world_size, dp_replicate=s.dp_replicate,
                        order=s.mesh_order, cp=s.cp, ep=s.ep), s


def rank_optimizer(model: nn.Module, strategy: Strategy, mesh, run: RunConfig, device: torch.device):
    """The run's optimizer over ``model``: ZeRO-1's partitioned one, or plain.

    A CPU-offloaded FSDP2 model steps on CPU.
    """
    device_type = "cpu" if strategy.cpu_offload else device.type
    if strategy.grad_sync is GradSync.ZERO1:  # ZeroRedundancyOptimizer, or with TP's DTensors the slice optimizer
        return build_zero1_optimizer(model, mesh["dp"], optimizer_class(run), slices=strategy.zero1_slices,
                                     **run.optimizer_kwargs(device_type))
    return build_optimizer(model.parameters(), run, device_type)


def _uncounted_shape_inference(stages: list, routing: RoutingLog) -> None:
    """Keep each stage's shape inference out of the routing records: before its first schedule step torch runs one
    micro-batch through the stage (the private ``_forward_metadata_inference``; a torch without it runs none)."""
    for stage in stages:
        infer = getattr(stage, "_forward_metadata_inference", None)
        if infer is not None:
            stage._forward_metadata_inference = functools.partial(_paused, routing, infer)


def _paused(routing: RoutingLog, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with routing.paused():
        return fn(*args, **kwargs)


class RankBuild:
    """This rank's part of the layout ``run`` names (module docstring); its meshes are kept warm (``kernels.parallel.warm_meshes``).

    ``model`` is what the flat step runs (DDP wrapper included; None with pp),
    ``params_module`` the module whose parameters the optimizer steps (the unwrapped
    model, or the ``nn.ModuleList`` of this rank's stages), ``pipe`` the pipeline runtime.
    """

    def __init__(self, run: RunConfig) -> None:
        freeze_long_lived()  # before anything of this build exists: its closing collection scans only the build's
        meta_shape_propagation.install()  # a mesh's first DTensor ops propagate their shapes in C++, not FakeTensor
        self.run = run
        self.dims, self.strategy = dims_and_strategy(run, run.world_size or dist.get_world_size())
        self.device = runtime.rank_device()
        if self.device.type == "cuda":  # TF32 matmuls for what runs in fp32, as torch users set it on Ampere and later
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        # Collective over every rank of the process group; kept warm for the next run of the same shape.
        self.mesh_keys: list = []  # the warm meshes this build holds until close()
        self.mesh = self._mesh(build_mesh)
        self.dp_mesh = self._mesh(build_hsdp_mesh) if self.strategy.hybrid else None
        self.cp_mesh = self._mesh(build_cp_mesh) if self.dims.cp > 1 else None
        self.ep_mesh = self._mesh(build_ep_mesh) if self.dims.ep > 1 else None
        self.idle = self.mesh.get_coordinate() is None
        # Context parallelism: this rank's place in its ring, and the ring steps of the last step's forward.
        self.cp_rank = self.cp_mesh.get_local_rank() if self.cp_mesh is not None and not self.idle else 0
        self.ring_log = RingLog(dist.get_rank(), self.cp_rank, self.dims.cp) \
            if self.cp_mesh is not None and not self.idle else None
        self.model = self.pipe = self.params_module = self.optimizer = None  # an idle rank holds nothing
        self.routing: RoutingLog | None = None  # each MoE layer's routing per step (no layers: a dense model)
        # lab.PoisonBatch: the loss the layout calls, poisoned at the run's chosen steps (kernels.train.poisoned_loss)
        self.loss, self.poison = poisoned(model_loss(model_config(run)), run.poison)
        if not self.idle:
            self._build_pipeline() if self.dims.pp > 1 else self._build_flat()
            ep_rank = self.ep_mesh.get_local_rank("ep") if self.ep_mesh is not None else 0
            self.routing = RoutingLog(list(self.pipe.modules) if self.pipe else [self.params_module], dist.get_rank(),
                                      ep_rank, self.dims.ep)
            if self.pipe and self.routing.layers:
                _uncounted_shape_inference(self.pipe.stages, self.routing)

    def _mesh(self, builder: Callable[[ParallelDims, str], DeviceMesh]) -> DeviceMesh:
        device_type = self.device.type
        key = (builder.__name__, self.dims, device_type)
        self.mesh_keys.append(key)
        return warm_mesh(key, lambda: builder(self.dims, device_type), device_type)

    def _build_flat(self) -> None:
        self.model = parallelize(build_model(model_config(self.run), device=self.device), self.strategy, self.mesh,
                                 self.dp_mesh, self.cp_mesh, self.ring_log, ep_mesh=self.ep_mesh)
        self.params_module = unwrap(self.model)
        self.optimizer = rank_optimizer(self.params_module, self.strategy, self.mesh, self.run, self.device)
        if self.run.measure:  # reroutes DDP's buckets through Python, before the first backward
            step_probe(self.model, self.optimizer, self.device)
        expert_sync = ExpertGradSync(expert_parameters(self.params_module), self.ep_mesh, self.dims.data) \
            if self.ep_mesh is not None else None
        dp_average = functools.partial(average_gradients, self.params_module, dp_group(self.mesh)) \
            if self.strategy.zero1_slices and self.dims.data > 1 else None  # no DDP there: the step averages
        self.step_fn = FlatStep(self.model, self.strategy.microbatches, self.strategy.loss_parallel, self.device,
                                self.loss, expert_sync, dp_average)

    def _build_pipeline(self) -> None:
        run, dims, strategy, mesh, cfg = self.run, self.dims, self.strategy, self.mesh, model_config(self.run)
        transform = functools.partial(parallelize, strategy=strategy, mesh=mesh, dp_mesh=self.dp_mesh,
                                      cp_mesh=self.cp_mesh, ring_log=self.ring_log)  # each stage's attention a ring
        shapes = functools.partial(stage_examples, cfg, strategy, run.global_batch // dims.data,
                                   tp_mesh=mesh["tp"] if dims.tp > 1 else None)  # torch need not infer them
        self.pipe = pipeline.build_pipeline(cfg, strategy.schedule, pp_rank(mesh), dims.pp,
                                            strategy.stages_per_rank, strategy.microbatches, pp_group(mesh),
                                            self.device, self.loss, model_transform=transform,
                                            stage_layers=strategy.stage_layers, stage_shapes=shapes)
        self.params_module = nn.ModuleList(self.pipe.modules)  # this rank's stages, for the optimizer and norms
        self.optimizer = rank_optimizer(self.params_module, strategy, mesh, run, self.device)
        by_hand = strategy.grad_sync in (GradSync.ALLREDUCE, GradSync.ZERO1) and dims.data > 1  # dp·cp ranks meet
        self.tied = TiedGrads(self.pipe.modules, pp_group(mesh), self.device) \
            if isinstance(cfg, OwnConfig) and cfg.spec.get("tied") else None
        self.step_fn = PipelineStep(self.pipe, self.params_module, dp_group(mesh) if by_hand else None,
                                    pp_group(mesh), self.device, self.tied)

    def batches(self, first: int, steps: int) -> BatchStream:
        """This rank's share of the global batches ``first`` .. ``first + steps - 1``."""
        return BatchStream(dataset(self.run), steps=first + steps, first_step=first,
                           global_batch=self.run.global_batch, dp_rank=self.dims.batch_rank(dp_rank(self.mesh)),
                           dp=self.dims.dp, cp=self.dims.cp, cp_rank=self.cp_rank, device=self.device)

    def attach(self, watch) -> None:
        """Let a ``kernels.watch.rank_watch.RankWatch`` see this build's modules and optimizer."""
        if self.pipe:
            watch.attach(list(self.pipe.modules), self.optimizer, list(self.pipe.stage_ids))
        else:
            watch.attach([self.model], self.optimizer)

    def probes(self) -> tuple[StepProbe | None, PipelineTracer | None]:
        """The run's step probe (with ``measure``) and pipeline tracer (with ``trace`` and pp), or None."""
        probe = tracer = None
        if self.run.measure:
            probe = PipelineProbe(self.params_module, self.optimizer, self.device, self.pipe.stages) if self.pipe \
                else StepProbe(self.model, self.optimizer, self.device)
        if self.run.trace and self.pipe:
            tracer = PipelineTracer(self.run, self.pipe, self.device, self.params_module, self.optimizer)
        return probe, tracer

    def records(self, return_params: bool) -> dict[str, Any]:
        """The layout record and, when asked, the whole parameters (a collective for DTensors: all ranks or none)."""
        rank, strategy, dims = dist.get_rank(), self.strategy, self.dims
        if self.pipe:
            pipe = self.pipe
            layout = {"rank": rank, "coords": dims.coords(rank), "strategy": f"pp-{pipe.schedule_name}",
                      "dp_strategy": strategy.kind, "zero": strategy.zero, "hybrid": strategy.hybrid,
                      "describe": strategy.describe(),
                      "schedule": pipe.schedule_name, "stage_ids": list(pipe.stage_ids),
                      "stage_layers": {str(s): list(layout_rules.layer_split(sum(pipe.stage_layers), pipe.num_stages,
                                                                             s, pipe.stage_layers))
                                       for s in pipe.stage_ids},
                      "params": {k: v for module in pipe.modules for k, v in describe_params(module).items()}}
        else:
            layout = {"rank": rank, "coords": dims.coords(rank), "strategy": strategy.kind, "zero": strategy.zero,
                      "hybrid": strategy.hybrid, "describe": strategy.describe(), "params": describe_params(self.params_module)}
        if strategy.zero1_slices:  # every rank holds a slice of every parameter's state: which one, per name
            slices = self.optimizer.owned_slices(self.params_module)
            layout["optimizer_slices"] = {n.split(".", 1)[1] if self.pipe else n: list(b) for n, b in slices.items()}
        elif strategy.grad_sync is GradSync.ZERO1:  # a stage list's names are "<index>.<parameter name>"
            owned = owned_parameters(self.optimizer, self.params_module)
            layout["optimizer_params"] = [n.split(".", 1)[1] for n in owned] if self.pipe else owned
        params = {}
        if return_params:
            for module in self.pipe.modules if self.pipe else [self.params_module]:
                params.update({k: v.tolist() for k, v in full_parameters(module).items()})
        return {"layout": layout, "params": params}

    def measure_record(self, layout: dict[str, Any], probe: StepProbe, loss: float) -> dict[str, Any]:
        """``kernels.train.measured_run``'s record of the probed step beside the layout it measured."""
        if not self.pipe:
            return measure_record(layout, self.dims, self.device, probe, loss=loss, optimizer=self.run.optimizer,
                                  microbatches=self.strategy.microbatches, **self._activation_sizes(),
                                  **self._fsdp_units())
        return measure_record(layout, self.dims, self.device, probe, strategy=self.strategy.kind, loss=loss,
                              optimizer=self.run.optimizer,
                              num_stages=self.pipe.num_stages, microbatches=self.pipe.num_microbatches,
                              tied_bytes=self.tied.payload_bytes if self.tied else 0, **self._activation_sizes(),
                              **self._fsdp_units())

    def _fsdp_units(self) -> dict[str, Any]:
        """Under FSDP2, what the memory and comm predictions need of its units: each unit's reshard_after_forward,
        and the blocks' module names (a parameter under none of them is the root's)."""
        if self.strategy.grad_sync is not GradSync.FSDP:
            return {}
        modules = self.pipe.modules if self.pipe else [self.params_module]
        return {"reshard_after_forward": self.strategy.reshard_units,
                "block_units": [name for module in modules for name in block_unit_names(module)]}

    def _activation_sizes(self) -> dict[str, Any]:
        """What ``kernels.contract.activation_rules`` needs to predict the measured activations by part: the model's sizes,
        the micro-batch and the flags that change what is saved."""
        run, s = self.run, self.strategy
        return {"model": dict(run.model),
                "micro_batch": run.global_batch // (self.dims.dp * s.microbatches),
                "activation_checkpointing": s.activation_checkpointing, "mixed_precision": s.mixed_precision,
                "precision": "autocast" if s.autocast else ("bf16" if s.mixed_precision else "fp32"),
                "sequence_parallel": s.sequence_parallel, "loss_parallel": s.loss_parallel, "compile": s.compile}

    def trace_record(self, tracer: PipelineTracer) -> dict[str, Any]:
        """The pipeline tracer's record of this rank's place in the mesh."""
        return tracer.record(pp_rank(self.mesh), dp_rank(self.mesh), self.dims.dp, self.dims.pp)

    def update_rules(self, before_update: Callable[[], None]) -> UpdateRules:
        """The run's spike guard, clipping by the global norm and lr schedule around this rank's optimizer step
        (``kernels.train.update_rules``), calling ``before_update()`` first; the caller places it at the run's
        step (``seek``) before training."""
        def clip(max_norm: float) -> torch.Tensor:
            norm = self.step_fn.grad_norm()  # the whole gradient's, over every shard, stage and mesh
            clip_to_norm(self.params_module, norm, max_norm)
            return norm
        return UpdateRules(self.optimizer, self.run, clip, self.poison, before_update)

    def watch(self) -> RankWatch | None:
        """The run's ``RankWatch`` (collectives published, faults struck) when it asks to be watched or carries
        faults, else None: one decision for a one-call run and a held training alike."""
        if not (self.run.watch_collectives or self.run.faults):
            return None
        synthetic = self.run.synthetic_forward_s if self.dims.pp == 1 else None  # with pp the tracer pads actions
        return RankWatch([self.mesh, self.dp_mesh], self.run.faults, synthetic)

    def after_step(self, first: int, then: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        """``train_loop``'s ``on_step`` for a segment that starts at step ``first``: close the step's routing records
        (a model with experts), then ``then(step, loss)`` (the checkpoints)."""
        if self.routing is None or not self.routing.layers:
            return then

        def after(step: int, loss: Any) -> None:
            self.routing.end_step(first + step)
            then(step, loss)
        return after

    def routing_records(self) -> dict[str, Any]:
        """``{"routing_steps": [RoutingStep dicts]}`` of the steps closed since the last call (a model with experts),
        else nothing."""
        return {"routing_steps": self.routing.take()} if self.routing is not None and self.routing.layers else {}

    def close(self) -> None:
        """Let go of the run's hooks and its meshes, which stay warm (``kernels.parallel.warm_meshes``)."""
        if self.routing is not None:
            self.routing.close()
        for key in self.mesh_keys:
            let_go(key)
        self.mesh_keys = []
