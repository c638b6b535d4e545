"""The one training loop, for every layout: ``train_loop(step_fn, optimizer, ...)``.

Algorithm: synchronous minibatch AdamW. Every rank builds the same global batch and
keeps its dp shard (``shard_batch``, through ``kernels.train.batches.BatchStream``, which builds
ahead on a GPU); tp ranks of one dp index see the same samples.
Each step runs the step function the strategy chose, then the optimizer:

- ``FlatStep`` (pp == 1): the shard is split into micro-batches; gradients accumulate
  over them and meet over dp on the last one (DDP's bucketed all-reduce, FSDP2's
  reduce-scatter, or nothing to do with TP alone); ZeRO-1 over TP's DTensors, which has no
  DDP, averages them after it (``average_gradients``); with expert parallelism the experts'
  gradients meet after it (``kernels.parallel.expert_parallel.ExpertGradSync``);
- ``PipelineStep`` (pp > 1): one schedule step over m micro-batches
  (``kernels.parallel.pipeline``), then, unless FSDP reduced them already, an
  all_reduce(SUM) over dp of the gradients in flat buckets and a divide by dp
  (``average_gradients``), through their local shards for TP DTensors.

Around the optimizer step, ``kernels.train.update_rules.UpdateRules`` applies the run's training
hygiene: a spike guard that skips the update of a bad batch, clipping by the global norm, the lr
schedule. The reported loss of a step is the global-batch mean: the replica's loss (with pp,
sent from the last stage's rank over the pp group) all_reduced (SUM) over dp, / dp.
The gradient norm is the whole gradient's, summed in squares over a pipeline's stages.
Losses and norms stay on the device and step times are CUDA events on a GPU, all read
once after the last step: the loop never waits for the device, so a GPU rank queues
the next step while the current one runs, as a plain torch loop does (a spike guard reads each
step's loss on the host before the update: with one, each step waits for its loss).
Measuring (probes, the tracer) attaches through ``kernels.train.step_hooks.StepHooks``; live
progress and stopping through ``kernels.watch.progress`` (one call per finished step).

Run alone (through the rank function that builds the layout)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 3
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from kernels.train.batches import BatchStream
from kernels.train.data import microbatches
from kernels.model.gpt import loss_fn
from kernels.model.moe import scale_aux_gradient
from kernels.parallel import pipeline
from kernels.parallel.ddp import sync_gradients
from kernels.parallel.mesh import local_part
from kernels.parallel.p2p_staging import needs_staging, staged_p2p
from kernels.parallel.tensor_parallel import loss_context
from kernels.parallel.tied_stages import TiedGrads
from kernels.train.step_hooks import StepHooks
from kernels.train.update_rules import UpdateRules


class FlatStep:
    """pp == 1: forward and backward over the shard's micro-batches; returns the replica's loss (float32)."""

    def __init__(self, model: nn.Module, microbatches: int, loss_parallel: bool, device: torch.device,
                 loss: Callable = loss_fn, expert_sync: Callable[[], None] | None = None,
                 dp_average: Callable[[], None] | None = None) -> None:
        self.model, self.n_micro, self.loss_parallel, self.device = model, microbatches, loss_parallel, device
        self.loss = loss  # of (logits, targets): the model's own (kernels.model.family.model_loss)
        self.expert_sync = expert_sync  # expert parallelism: the experts' gradients, which DDP/FSDP leave alone
        self.dp_average = dp_average  # ZeRO-1 over TP's DTensors: no DDP, so the gradients are averaged over dp here
        scale_aux_gradient(model, 1 / microbatches)  # a MoE's balance-loss gradient, divided as the loss is

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, hooks: StepHooks) -> torch.Tensor:
        local = torch.zeros((), device=self.device)
        pairs = list(zip(microbatches(inputs, self.n_micro), microbatches(targets, self.n_micro)))
        for i, (x, y) in enumerate(pairs):
            last = i == len(pairs) - 1
            with sync_gradients(self.model, sync=last), loss_context(self.loss_parallel), hooks.part():
                with hooks.forward(last):
                    loss = self.loss(self.model(x.to(self.device)), y.to(self.device)) / self.n_micro  # shard mean
                loss.backward()
            # Under loss_parallel the loss is a replicated DTensor: every tp rank holds the value.
            local += loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()
        for sync in (self.dp_average, self.expert_sync):
            if sync is not None:
                with hooks.part("all_reduce"):  # a part of its own, so a measured step meters it
                    sync()
        return local

    def replica_loss(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.model, self.device)


class PipelineStep:
    """pp > 1: one schedule step, then the dp gradient average unless FSDP did it; returns the last stage's loss."""

    def __init__(self, runtime: pipeline.PipelineRuntime, stack: nn.Module, average_over: dist.ProcessGroup | None,
                 pp_group: dist.ProcessGroup, device: torch.device, tied: TiedGrads | None = None) -> None:
        self.runtime, self.params_module, self.average_over = runtime, stack, average_over
        self.pp_group, self.device, self.tied = pp_group, device, tied
        # A tied head's last-stage copy equals the embedding's after the sum: the norm counts it once.
        self.skip_in_norm = tied.head_copies(runtime.modules) if tied else set()
        self.stage_p2p = needs_staging(device, pp_group)  # gloo ranks sharing a GPU

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, hooks: StepHooks) -> torch.Tensor | None:
        # Staging first, so a tracer wraps the staged p2p and still sees the schedule's own ops.
        with staged_p2p(self.stage_p2p), hooks.schedule(self.runtime.stages):
            loss = pipeline.pipeline_step(self.runtime, inputs, targets)  # the last stage's loss, else None
        if self.average_over is not None:
            with hooks.part("all_reduce", nbytes=_grad_bytes(self.params_module)):
                average_gradients(self.params_module, self.average_over)
        if self.tied is not None:
            self.tied.sum_gradients()
        return loss

    def replica_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """Reporting only: the replica's loss from its last stage to every pp rank (float64)."""
        return pipeline.share_loss(loss, self.pp_group, self.device)

    def grad_norm(self) -> torch.Tensor:
        """This rank's stages, then summed in squares over the pipeline (stays on the device)."""
        sq = grad_norm(self.params_module, self.device, skip=self.skip_in_norm) ** 2
        dist.all_reduce(sq, group=self.pp_group)
        return sq.sqrt()


def train_loop(step_fn: FlatStep | PipelineStep, optimizer, batches: BatchStream, *, dp: int,
               dp_group: dist.ProcessGroup, hooks: StepHooks,
               record_grad_norm: bool = True, on_step: Callable[[int, torch.Tensor], None] | None = None,
               progress=None, update: UpdateRules | None = None) -> tuple[list[float], list[float], list[float]]:
    """Run one optimizer step per batch of ``batches``; returns (global mean losses, step seconds, grad norms).

    ``update`` (``kernels.train.update_rules``) guards, clips and schedules each optimizer step (None: a
    plain ``optimizer.step()``); a spike guard reads the global loss, so it is reduced before the update.
    ``on_step(step, loss)`` runs after each step, outside its clock (checkpoints). ``progress``
    (``kernels.watch.progress.ProgressReporter``) hears of each finished step and may end the run there.
    """
    losses, norms, clock = [], [], StepClock(batches.device)
    for step, (inputs, targets) in enumerate(batches):  # (B/dp, T) each
        hooks.begin(step)  # tracing: clocks aligned, ranks met
        clock.start()
        if update is not None:
            update.begin()
        norm = reduced = None
        with hooks.whole_step():
            loss = step_fn(inputs, targets, hooks)
            if update is not None and update.needs_loss:
                reduced = global_loss(step_fn, loss, dp, dp_group)
            with hooks.part("optimizer"):  # clipping's norm and the guard are part of the update
                if update is None:
                    optimizer.step()
                else:
                    norm = update.apply(reduced)
        hooks.at_rest()
        if record_grad_norm:  # step() leaves .grad alone; here it is outside the meter (clipping took it before)
            norms.append(norm if norm is not None else step_fn.grad_norm())
        optimizer.zero_grad(set_to_none=not hooks.keeps_gradients)
        clock.stop()
        losses.append(reduced if reduced is not None else global_loss(step_fn, loss, dp, dp_group))
        if on_step is not None:
            on_step(step, losses[-1])
        if progress is not None and progress.step_done(step, losses[-1], clock):
            break  # every rank agreed to stop at this step boundary
    return (torch.stack(losses).tolist() if losses else [], clock.seconds(),
            torch.stack(norms).tolist() if norms else [])


def global_loss(step_fn: FlatStep | PipelineStep, loss: torch.Tensor | None, dp: int,
                dp_group: dist.ProcessGroup) -> torch.Tensor:
    """The global-batch mean loss (float64): forward all_reduce(SUM) of the replicas' losses over dp, then / dp.

    Every rank ends with the same value, so a spike guard judging it decides alike everywhere.
    """
    replica_loss = step_fn.replica_loss(loss).double()
    dist.all_reduce(replica_loss, group=dp_group)
    return replica_loss / dp


class StepClock:
    """Each step's duration without waiting for the device: CUDA events on a GPU, read at the end; else the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[list] = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks.append([self._mark()])

    def stop(self) -> None:
        self.marks[-1].append(self._mark())

    def seconds(self) -> list[float]:
        """Every step's seconds (on a GPU this waits once, for the last step to finish)."""
        if not self.cuda:
            return [end - begin for begin, end in self.marks]
        if self.marks:
            self.marks[-1][1].synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in self.marks]


def grad_norm(model: nn.Module, device: torch.device, skip: set[int] = frozenset()) -> torch.Tensor:
    """The L2 norm of the whole (dp-averaged) gradient, as one process would compute it: a float64 scalar on ``device``.

    Sums of squares are taken on local shards and all-reduced once per (mesh, sharded mesh dims)
    group, not once per parameter: ``torch.nn.utils.get_total_norm`` cannot stack norms from the
    different meshes FSDP x TP leaves (dp-only for norms, (dp, tp) for the rest), and a
    ``full_tensor()`` per parameter costs a collective each. Replicated dims are not summed (every
    rank there holds the same values); a Partial gradient is reduced first, as squares of a sum
    are not sums of squares. Plain gradients are whole (DDP) or the same on every tp rank.
    The sums stay tensors, so the norm costs no host sync (a GPU rank keeps running ahead).
    ``skip``: ids of parameters not counted (a second copy of a tied tensor).
    """
    total, groups = torch.zeros((), dtype=torch.float64, device=device), {}
    for p in model.parameters():
        g = p.grad
        if g is None or id(p) in skip:
            continue
        if not isinstance(g, DTensor):
            total += g.detach().double().pow(2).sum().to(device)  # a CPU-offloaded gradient too
            continue
        if any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
        dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())  # Shard, _StridedShard
        key = (g.device_mesh, dims)
        groups[key] = groups.get(key, 0.0) + g.to_local().double().pow(2).sum()
    # Every rank of a group holds the same modules, so each meets the groups in the same order.
    for (mesh, dims), squares in groups.items():
        for d in dims:
            dist.all_reduce(squares, group=mesh.get_group(d))
        total += squares.to(device)
    return total.sqrt()


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap: one all-reduce per bucket, not one per parameter


def average_gradients(model: nn.Module, group: dist.ProcessGroup, bucket_bytes: int = BUCKET_BYTES) -> None:
    """all_reduce(SUM) the gradients over ``group`` in flat buckets, as DDP does, then / its size.

    One call per parameter (``kernels.train.data_parallel_naive``'s way) pays each call's latency
    dozens of times a step; the buckets pay it once per ``bucket_bytes`` of one dtype. A TP DTensor
    gradient takes part through its local shard: the dp ranks at one tp index hold the same shard,
    and outside grad mode ``to_local()`` is the shard itself, so copying back updates the DTensor.
    """
    n = dist.get_world_size(group)
    with torch.no_grad():
        grads = [local_part(p.grad) for p in model.parameters() if p.grad is not None]
        for bucket in _buckets(grads, bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat /= n
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, each group at most ``bucket_bytes`` (or a single tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if last is None or (last[0].dtype, last[0].device) != (g.dtype, g.device) or size + nbytes > bucket_bytes:
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of this rank's local gradients: what ``average_gradients`` all-reduces."""
    grads = [local_part(g) for g in (p.grad for p in model.parameters())
             if g is not None]
    return sum(g.numel() * g.element_size() for g in grads)
