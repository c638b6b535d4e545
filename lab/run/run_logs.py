"""Per-step logs that ML people already read: TensorBoard and Weights & Biases, fed by ``StepProgress``.

``log_to="tensorboard:DIR"`` writes through ``torch.utils.tensorboard.SummaryWriter``
(one event file in DIR): each rank's scalars under ``rank<r>/``, and once every rank has
reported a step, the step's aggregate under ``all/``: the loss (the global-batch mean,
the same on every rank), the slowest rank's step time, the run's tokens/s at that pace,
the mean and the largest time waiting in collectives. ``log_to="wandb"`` logs the same
keys to one offline W&B run per experiment (``pip install cluster-lab[wandb]``), so every
rank's curves sit in one dashboard, grouped by their ``rank<r>/`` prefix.
"""
from __future__ import annotations

import abc
import importlib.util
from typing import Any

from kernels.contract.watch_records import StepProgress
from lab.run.parallel import ParallelConfigError

_PER_RANK = ("loss", "step_s", "tokens_per_s", "collective_s", "compute_s", "memory_bytes")


def step_aggregate(records: list[StepProgress]) -> dict[str, float]:
    """One step's figures over every rank (``records``: that step's record of each rank)."""
    slowest = max(r.step_s for r in records)
    waits = [r.collective_s for r in records]
    return {"all/loss": records[0].loss, "all/step_s_max": slowest,
            "all/tokens_per_s": records[0].tokens_per_s * records[0].step_s / slowest if slowest > 0 else 0.0,
            "all/collective_s_mean": sum(waits) / len(waits), "all/collective_s_max": max(waits)}


class _StepLog(abc.ABC):
    """Scalars per rank as records come, and each step's aggregate once every rank has sent it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._by_step: dict[int, dict[int, StepProgress]] = {}

    def write(self, records: list[StepProgress]) -> None:
        for record in records:
            self.scalars(record.step, {f"rank{record.rank}/{k}": float(getattr(record, k)) for k in _PER_RANK})
            ranks = self._by_step.setdefault(record.step, {})
            ranks[record.rank] = record
            if len(ranks) == self.world_size:
                self.scalars(record.step, step_aggregate([ranks[r] for r in sorted(ranks)]))
                del self._by_step[record.step]

    @abc.abstractmethod
    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write ``values`` (name -> number) at ``step``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and close the log."""


class TensorBoardLog(_StepLog):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter`` into ``logdir``."""

    def __init__(self, logdir: str, world_size: int) -> None:
        super().__init__(world_size)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbLog(_StepLog):
    """One offline W&B run for the experiment; every rank's keys in it."""

    def __init__(self, config: dict[str, Any], world_size: int) -> None:
        super().__init__(world_size)
        import wandb

        self.run = wandb.init(project="cluster-lab", mode="offline", config=config, reinit="create_new")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_loggers(log_to: str | None, config: dict[str, Any], world_size: int) -> list[_StepLog]:
    """The loggers ``log_to`` names (none for None); a bad value or a missing package is an error here, before launch."""
    if log_to is None:
        return []
    if isinstance(log_to, str) and log_to.startswith("tensorboard:") and log_to.split(":", 1)[1]:
        if importlib.util.find_spec("tensorboard") is None:
            raise ParallelConfigError([("log-to", "log_to='tensorboard:DIR' needs the tensorboard package "
                                                  "(pip install tensorboard)")])
        return [TensorBoardLog(log_to.split(":", 1)[1], world_size)]
    if log_to == "wandb":
        if importlib.util.find_spec("wandb") is None:
            raise ParallelConfigError([("log-to", "log_to='wandb' needs the wandb package "
                                                  "(pip install cluster-lab[wandb])")])
        return [WandbLog(config, world_size)]
    raise ParallelConfigError([("log-to", f"log_to must be 'tensorboard:DIR' or 'wandb', got {log_to!r}")])
