"""A run's checkpoints on the ranks: resume before the first step, save every K steps and after the last.

Built by ``kernels.train`` from the run config's ``checkpoint_dir``, ``checkpoint_every``,
``resume_from`` and ``checkpoint_async`` (all off by default: then it does nothing).
Batches are a pure function of (seed, step) (``kernels.data``), so the data position is
the step count: a run resumed at step k feeds batch k next, as the uninterrupted run
did. With the model, the AdamW state (step counts included) and each rank's RNG state
restored (``kernels.checkpoint``), the run goes on bit for bit under the same layout.

Run alone (trains 2 steps with a save, resumes for 2 more, compares with 4 in one go)::

    torchrun --nproc-per-node 2 -m kernels.run_checkpoints
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kernels.checkpoint import AsyncSaver, load_checkpoint, load_weights, save_checkpoint
from kernels.checkpoint_files import WEIGHTS_SUFFIX, resolve, step_dir
from kernels.parallel.strategy import Strategy
from kernels.run_config import RunConfig


class RunCheckpoints:
    """The run's saves and its resume point; ``model`` is the GPT or the list of this rank's pipeline stages."""

    def __init__(self, run: RunConfig, model: nn.Module, optimizer, strategy: Strategy) -> None:
        self.run, self.model, self.optimizer = run, model, optimizer
        self.layout = {"pp": strategy.pp, "dp": strategy.dp, "tp": strategy.tp, "zero": strategy.zero,
                       "schedule": strategy.schedule, "describe": strategy.describe()}
        self.first_step = 0
        self.saver = AsyncSaver() if run.checkpoint_dir and run.checkpoint_async else None

    def resume(self) -> int:
        """Load ``resume_from`` (a step directory, a checkpoint directory's latest, or a safetensors file); returns the step to start at."""
        source = self.run.resume_from
        if not source:
            return 0
        if str(source).endswith(WEIGHTS_SUFFIX):  # weights only: the optimizer starts fresh, from step 0
            load_weights(source, self.model)
            return 0
        meta = load_checkpoint(str(resolve(source)), self.model, self.optimizer)
        self.first_step = int(meta["step"])
        return self.first_step

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        """After local step ``step`` (0-based, counted from the resume point): save when one is due."""
        done = self.first_step + step + 1  # steps completed, counted from the start of training
        every, root = self.run.checkpoint_every, self.run.checkpoint_dir
        if not root or not (done == self.run.steps or (every and done % every == 0)):
            return
        meta = {"step": done, "data_step": done, "loss": float(loss), "config": self.run.to_dict(),
                "world_size": dist.get_world_size(), "layout": self.layout}
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


def _demo() -> None:
    from kernels.train import train_rank

    dist.init_process_group("gloo")
    root = os.environ.get("CKPT_DIR") or tempfile.mkdtemp(prefix="run-checkpoints-")
    model = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
    whole = train_rank(RunConfig(model=model, dp=dist.get_world_size(), steps=4).to_dict())
    train_rank(RunConfig(model=model, dp=dist.get_world_size(), steps=2, checkpoint_dir=root).to_dict())
    rest = train_rank(RunConfig(model=model, tp=dist.get_world_size(), steps=4,
                                resume_from=root).to_dict())
    if dist.get_rank() == 0:
        print("uninterrupted:", whole["losses"][2:], "\nresumed (DP -> TP):", rest["losses"])
    dist.destroy_process_group()


if __name__ == "__main__":
    _demo()
