"""A run's checkpoints on the ranks: resume before the first step, save every K steps and after the last.

Built from the run config's ``checkpoint_dir``, ``checkpoint_every``, ``resume_from`` and
``checkpoint_async`` (all off by default: then it does nothing) by both drivers of the loop:
``kernels.train.entry`` for a run in one call, and ``kernels.train.live_training`` for a
training held between calls, whose every ``advance`` is one segment (``RunCheckpoints.segment``).
So both save at the same steps (``save_due``), with the same meta (``checkpoint_meta``), the same way.
Batches are a pure function of (seed, step) (``kernels.train.data``), so the data position is
the step count: a run resumed at step k feeds batch k next, as the uninterrupted run
did. With the model, the AdamW state (step counts included) and each rank's RNG state
restored (``kernels.checkpoint.save_load``), the run goes on bit for bit under the same layout.

Run alone through the rank entry point, which sits above this module (2 steps under DP with a
save, then on to step 4 under TP from it, beside the one-process reference)::

    torchrun --nproc-per-node 2 -m kernels.train.entry --dp 2 --steps 2 --checkpoint-dir /tmp/ckpt
    torchrun --nproc-per-node 2 -m kernels.train.entry --tp 2 --steps 4 --resume-from /tmp/ckpt
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from kernels.train.batches import BatchStream

from kernels.checkpoint.async_save import AsyncSaver
from kernels.checkpoint.save_load import load_checkpoint, load_weights, save_checkpoint
from kernels.checkpoint.files import WEIGHTS_SUFFIX, resolve, step_dir
from kernels.contract.strategy import Strategy
from kernels.contract.run_config import RunConfig
from kernels.train.step_hooks import StepHooks


def save_due(done: int, last: int, every: int | None) -> bool:
    """Whether a save is due once ``done`` steps are complete: at each multiple of ``every``, and at ``last``.

    The one cadence of every training: an Experiment's run (``last`` = its steps) and each
    ``advance`` of a held training (``last`` = where that call ends).
    """
    return done == last or bool(every) and done % every == 0


def checkpoint_meta(run: RunConfig, strategy: Strategy, done: int, world_size: int, loss: float | None,
                    losses: list[float] | None = None) -> dict[str, Any]:
    """The meta every checkpoint carries (``meta.json``): where the run stands, its config and layout.

    A held training adds every loss so far (``losses``), so a rebuilt one goes on with them.
    """
    meta = {"step": done, "data_step": done, "loss": loss, "config": run.to_dict(), "world_size": world_size,
            "layout": {"pp": strategy.pp, "dp": strategy.dp, "tp": strategy.tp, "zero": strategy.zero,
                       "schedule": strategy.schedule, "describe": strategy.describe()}}
    if losses is not None:
        meta["losses"] = list(losses)
    return meta


class RunCheckpoints:
    """The run's saves and its resume point; ``model`` is the GPT or the list of this rank's pipeline stages.

    ``ranks`` are the layout's when it trains on fewer than the whole world (a held training;
    None: every rank), and ``group`` is their process group (None on a rank outside them). A one-call run trains steps ``first_step`` to
    ``run.steps``; a held training sets each call's span and its losses so far with ``segment``.
    """

    def __init__(self, run: RunConfig, model: nn.Module | None, optimizer, strategy: Strategy, *,
                 ranks: list[int] | None = None, group: dist.ProcessGroup | None = None) -> None:
        self.run, self.model, self.optimizer, self.strategy, self.group = run, model, optimizer, strategy, group
        self.first_step, self.last_step, self.load_seconds = 0, run.steps, 0.0
        self.save_blocked: list[float] = []  # per save, the seconds the training loop waited for it
        self.history: list | None = None  # a held training's losses (floats, then this call's tensors)
        self.saver = AsyncSaver(ranks) if run.checkpoint_dir and run.checkpoint_async else None

    def segment(self, first: int, last: int, losses: list[float]) -> None:
        """A held training's next call trains steps ``first`` to ``last``; its checkpoints carry ``losses`` so far too."""
        self.first_step, self.last_step, self.history = first, last, list(losses)

    def resume(self) -> int:
        """Load ``resume_from`` (a step directory, a checkpoint directory's latest, or a safetensors file).

        Returns the step to start at (0 after weights alone).
        """
        source, began = self.run.resume_from, time.perf_counter()
        if not source:
            return 0
        if str(source).endswith(WEIGHTS_SUFFIX):  # weights only: the optimizer starts fresh, from step 0
            load_weights(source, self.model)
        else:
            self.first_step = int(load_checkpoint(str(resolve(source)), self.model, self.optimizer)["step"])
        self.load_seconds = time.perf_counter() - began
        return self.first_step

    def record(self) -> dict[str, Any]:
        """The rank record's part: the step this run started at, how long its load took, and how long each save
        held the training up (an asynchronous one: the wait for the previous write, building what is saved, and the
        wait before the next optimizer step for the copy to CPU memory)."""
        return {"first_step": self.first_step, "load_seconds": self.load_seconds,
                "save_blocked_seconds": list(self.save_blocked)}

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        """After local step ``step`` (0-based, counted from the segment's first step): save when one is due."""
        done = self.first_step + step + 1  # steps completed, counted from the start of training
        if self.history is not None:
            self.history.append(loss)  # a tensor: read only when a save needs it
        root = self.run.checkpoint_dir
        if not root or not save_due(done, self.last_step, self.run.checkpoint_every):
            return
        losses = None if self.history is None else [float(x) for x in self.history]
        meta = checkpoint_meta(self.run, self.strategy, done, dist.get_world_size(self.group), float(loss), losses)
        path, began = str(step_dir(root, done)), time.perf_counter()
        if self.saver is not None:
            self.saver.save(path, self.model, self.optimizer, meta)
        else:
            save_checkpoint(path, self.model, self.optimizer, meta, process_group=self.group)
        self.save_blocked.append(time.perf_counter() - began)

    def before_update(self) -> None:
        """Right before the optimizer step: an asynchronous save's copy to CPU memory must be done; the wait counts as
        that save's blocked time."""
        if self.saver is not None and self.saver.staging is not None:
            self.save_blocked[-1] += self.saver.staged()

    def wait(self) -> None:
        """Return once every save so far is complete (a held training's call ends with its checkpoints named)."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        """Finish an asynchronous save still in flight, so the run returns only once its checkpoints are named."""
        if self.saver is not None:
            self.saver.close()
            self.saver = None


def settle_ddp_buckets(step_fn, batches: BatchStream, optimizer) -> None:
    """A resumed DDP model runs one forward and backward on its next batch, then drops the gradients.

    DDP rebuilds its gradient buckets after its first backward, in the order the gradients
    became ready; the all-reduce's float sums depend on where each gradient sits in a
    bucket (gloo cuts a buffer into chunks by size). The uninterrupted run reduced its later
    steps in rebuilt buckets, so without this the resumed first step would not be bit for
    bit the same. The step changes nothing else: no optimizer step, gradients set to None
    as after every step.
    """
    if not isinstance(getattr(step_fn, "model", None), DistributedDataParallel):
        return
    stream = iter(batches)
    inputs, targets = next(stream)
    stream.close()
    step_fn(inputs, targets, StepHooks(1))
    optimizer.zero_grad(set_to_none=True)

