"""A run's checkpoints on the ranks: resume before the first step, save every K steps and after the last.

Built by ``kernels.train.entry`` from the run config's ``checkpoint_dir``, ``checkpoint_every``,
``resume_from`` and ``checkpoint_async`` (all off by default: then it does nothing).
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
from kernels.parallel.strategy import Strategy
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
    """The run's saves and its resume point; ``model`` is the GPT or the list of this rank's pipeline stages."""

    def __init__(self, run: RunConfig, model: nn.Module, optimizer, strategy: Strategy) -> None:
        self.run, self.model, self.optimizer = run, model, optimizer
        everyone = dist.get_world_size()
        if (run.checkpoint_dir or run.resume_from) and (run.world_size or everyone) != everyone:
            raise ValueError("checkpoints are saved and loaded by every rank of the process group: run on all of them "
                             f"(world_size={run.world_size} of {everyone})")
        self.strategy = strategy
        self.first_step, self.load_seconds = 0, 0.0
        self.saver = AsyncSaver() if run.checkpoint_dir and run.checkpoint_async else None

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
        """The rank record's part: the step this run started at and how long its load took."""
        return {"first_step": self.first_step, "load_seconds": self.load_seconds}

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        """After local step ``step`` (0-based, counted from the resume point): save when one is due."""
        done = self.first_step + step + 1  # steps completed, counted from the start of training
        root = self.run.checkpoint_dir
        if not root or not save_due(done, self.run.steps, self.run.checkpoint_every):
            return
        meta = checkpoint_meta(self.run, self.strategy, done, dist.get_world_size(), float(loss))
        path = str(step_dir(root, done))
        if self.saver is not None:
            self.saver.save(path, self.model, self.optimizer, meta)
        else:
            save_checkpoint(path, self.model, self.optimizer, meta)

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

