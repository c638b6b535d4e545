"""Pipeline parallelism: cut the model (GPT or Llama) into stages and run a torch pipeline schedule.

The algorithm is micro-batched pipeline parallelism. The model's blocks are split
into ``num_stages`` contiguous stages, a batch is split into ``m`` micro-batches,
and the ranks pass activations forward and their gradients backward (p2p
send/recv) in the order a schedule prescribes:

- GPipe (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural Networks
  using Pipeline Parallelism"): all forwards, then all backwards;
- 1F1B (Narayanan et al., 2019, "PipeDream", and Megatron-LM): one forward, one
  backward in the steady state, so at most p micro-batches are in flight;
- interleaved 1F1B (Narayanan et al., 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM") and looped BFS (Lamy-Poirier, 2023,
  "Breadth-First Pipeline Parallelism"): v stages per rank, placed in a loop;
- interleaved zero bubble and ZBV (Qi et al., 2024, "Zero Bubble Pipeline
  Parallelism"): the backward split into input-grad (I) and weight-grad (W);
- DualPipeV (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report"): a V placement
  that pairs forward and backward chunks.

All of them come from ``torch.distributed.pipelining``; this module only decides
the stage placement, cuts the model with ``kernels.model.family.keep_stage`` and scales
the loss so the gradients equal the one-process reference. Stages are of equal depth, or
uneven as ``stage_layers`` gives (GPipe's ``balance``, Megatron's uneven first and last
stages): a first stage that also embeds, or a last one that also projects onto the
vocabulary and takes the loss, is given fewer blocks so that no stage holds up the rest.

``kernels.train.entry.train_rank`` composes it with DP, FSDP and TP on a (pp, dp, tp) mesh.
To run it alone (two CPU ranks, losses checked against one process), go through that
entry point, which sits above this module::

    torchrun --nproc-per-node 2 -m kernels.train.entry --pp 2 --layers 4 --heads 2 \
        --schedule 1f1b --microbatches 4 --global-batch 8
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS,
    ScheduleZBVZeroBubble)

from kernels.contract import layout_rules
from kernels.contract.layout_rules import Schedule
from kernels.model.family import ModelConfig, build_model, keep_stage
from kernels.model.moe import scale_aux_gradient

# gpipe/1f1b are PipelineScheduleSingle (take one stage); the rest take a list of stages.
# Names and placement families: kernels.contract.layout_rules.
SCHEDULE_CLASSES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    Schedule.LOOPED_BFS: ScheduleLoopedBFS,
    Schedule.INTERLEAVED_ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    Schedule.ZBV: ScheduleZBVZeroBubble,
    Schedule.DUALPIPEV: ScheduleDualPipeV,
}


@dataclass
class PipelineRuntime:
    """One rank's part of a pipeline: its stages, their modules and the schedule."""

    schedule_name: str
    stage_ids: list[int]  # global stage indices this rank holds, in placement order
    stage_layers: tuple[int, ...]  # blocks on every stage of the pipeline, in stage order (all ranks, not only this)
    modules: list[nn.Module]  # the local stage modules (after model_transform)
    stages: list[PipelineStage]
    schedule: Any  # a torch PipelineScheduleSingle or PipelineScheduleMulti
    num_stages: int
    num_microbatches: int
    device: torch.device
    has_first: bool  # holds stage 0: feeds the token ids
    has_last: bool  # holds the last stage: owns targets and losses


def check_schedule(schedule: str, pp_size: int, stages_per_rank: int, microbatches: int) -> None:
    """Raise ValueError, in words, for the placement and micro-batch rules torch's schedules enforce.

    The lab's own "pp-microbatches" rule (fewer micro-batches than ranks) is the driver's
    to warn about: torch runs such a pipeline, and so do the ranks.
    """
    problems = [*layout_rules.stage_problems(schedule, stages_per_rank),
                *layout_rules.microbatch_problems(schedule, pp_size, stages_per_rank, microbatches)]
    problems = [message for rule, message in problems if rule != "pp-microbatches"]
    if problems:
        raise ValueError("; ".join(problems))


class MicrobatchMeanLoss:
    """``loss_fn(out, y) / m``: summed over m micro-batches, the gradient is the full-batch mean's.

    We scale the loss rather than use the schedule's ``scale_grads=True``, which
    divides *every* ``.grad`` after the step and so would also shrink gradients
    accumulated over earlier steps (gradient accumulation). torchtitan does the same.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], m: int) -> None:
        self.loss_fn, self.m = loss_fn, m

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.m  # scalar; output (b, T, V), target (b, T)


def build_pipeline(cfg: ModelConfig, schedule: str, pp_rank: int, pp_size: int,
                   stages_per_rank: int, microbatches: int, pp_group: dist.ProcessGroup | None,
                   device: torch.device | str, loss_fn: Callable, *,
                   model_transform: Callable[[nn.Module], nn.Module | None] | None = None,
                   stage_layers: Sequence[int] | None = None,
                   stage_shapes: Callable[[int, int], dict[str, Any]] | None = None) -> PipelineRuntime:
    """Build this rank's stages of the seeded model (``kernels.model.family``) and the torch schedule that runs them.

    ``model_transform(module)`` is applied to each stage module before it is wrapped
    (the hook for TP/FSDP/DDP on a sub-mesh); it may change the module in place
    (return None) or return a replacement. ``stage_layers``: blocks per stage (pp·v counts, in
    stage order); None cuts equal stages.
    """
    schedule = layout_rules.canonical_schedule(schedule)
    check_schedule(schedule, pp_size, stages_per_rank, microbatches)
    device = torch.device(device)
    num_stages = pp_size * stages_per_rank
    stage_ids = list(layout_rules.stage_ids(schedule, pp_rank, pp_size, stages_per_rank))
    full = build_model(cfg, device)  # every rank builds the same seeded weights, no broadcast needed
    blocks = len(full.blocks)
    modules, stages = [], []
    for i, sid in enumerate(stage_ids):
        # keep_stage cuts in place and each stage owns its tensors: a copy for every stage but the last, which
        # takes the model itself (a third of a PP2 build's time went to copying it for the one stage).
        whole = full if i == len(stage_ids) - 1 else copy.deepcopy(full)
        module = keep_stage(whole, sid, num_stages, stage_layers)
        scale_aux_gradient(module, 1 / microbatches)  # a MoE's balance-loss gradient, divided as the loss is
        if model_transform is not None:
            module = model_transform(module) or module
        modules.append(module)
        examples = stage_shapes(sid, num_stages) if stage_shapes is not None else {}
        stages.append(PipelineStage(module, sid, num_stages, device, group=pp_group, **examples))
    del full
    scaled_loss = MicrobatchMeanLoss(loss_fn, microbatches)
    single = schedule in layout_rules.SINGLE_STAGE_SCHEDULES
    sched = SCHEDULE_CLASSES[schedule](stages[0] if single else stages, n_microbatches=microbatches,
                                       loss_fn=scaled_loss, scale_grads=False)
    split = tuple(len(layout_rules.layer_split(blocks, num_stages, s, stage_layers)) for s in range(num_stages))
    return PipelineRuntime(schedule, stage_ids, split, modules, stages, sched, num_stages, microbatches,
                           device, has_first=0 in stage_ids, has_last=num_stages - 1 in stage_ids)


def pipeline_step(runtime: PipelineRuntime, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """Run one forward+backward over ``inputs`` (B, T) split into m micro-batches.

    Gradients accumulate in the stage modules (call the optimizer yourself). Returns
    the mean micro-batch loss (a device scalar) on the rank holding the last stage, None elsewhere.
    Every rank of the pipeline must call this; only the first/last use inputs/targets.
    """
    args = (inputs.to(runtime.device),) if runtime.has_first else ()  # (B, T) token ids
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    if runtime.has_last:
        kwargs = {"target": targets.to(runtime.device), "losses": losses}  # target (B, T)
    # return_outputs=False: we only need the losses, not the merged (B, T, V) logits.
    runtime.schedule.step(*args, return_outputs=False, **kwargs)
    if not runtime.has_last:
        return None
    # Each entry is loss_i / m, so their sum is the mean over micro-batches.
    return torch.stack([loss.detach().float() for loss in losses]).sum()


def share_loss(loss: torch.Tensor | None, pp_group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """This replica's loss on every rank of its pipeline, as a float64 scalar tensor.

    Exactly one rank of a pp group holds the last stage (``pipeline_step`` returns its
    loss, None elsewhere), so all_reduce(SUM) over the pp group acts as a broadcast
    from it without knowing its global rank (pp rank p-1, or 0 for the V schedules).
    """
    value = torch.zeros((), dtype=torch.float64, device=device) if loss is None else loss.to(device, torch.float64)
    dist.all_reduce(value, group=pp_group)
    return value


def planned_compute_order(runtime: PipelineRuntime, pp_rank: int) -> list[list] | None:
    """Torch's planned compute actions for this rank as [stage, "F"|"B"|"I"|"W", microbatch].

    ``schedule.pipeline_order`` is private and, for GPipe and 1F1B in torch 2.8-2.13,
    wrong; the driver builds its own for those. None when torch has none.
    """
    try:
        order = getattr(runtime.schedule, "pipeline_order", None)
        actions = order.get(pp_rank) if order else None
        if actions is None:
            return None
        out: list[list] = []
        for action in actions:
            for sub in (action.sub_actions or (action,)) if action is not None else ():
                letter = getattr(sub.computation_type, "value", str(sub.computation_type))
                if letter in ("F", "B", "I", "W"):
                    out.append([int(sub.stage_index), letter, int(sub.microbatch_index)])
        return out
    except (AttributeError, TypeError, ValueError):
        return None

