"""Cluster Lab: learn and test distributed training on real torch.distributed ranks.

Start here::

    import lab
    cluster = lab.start()        # one rank per GPU (NCCL), or 4 CPU ranks (gloo)
    cluster.run(fn, *args)       # runs fn on every rank; results indexed by rank

Names are imported on first use: engines unpickle functions by importing the module
that defined them, and a script that does ``import lab`` must not make every engine
import widgets, the planner and DTensor before its first call can run.
"""
from __future__ import annotations

import importlib
from typing import Any

from lab._shadow_guard import check_own_packages

check_own_packages()

_HOME = {
    "bench_collectives": "lab.bench",
    "Cluster": "lab.cluster", "OversubscribedWarning": "lab.cluster_world",
    "ConfigError": "kernels.config_rules",
    "Controls": "lab.controls",
    "GPTConfig": "kernels.model",
    "DryRunReport": "lab.dry_run", "dry_run": "lab.dry_run",
    "DeadRankError": "lab.errors", "LabError": "lab.errors", "PoolStoppedError": "lab.errors",
    "PoolBusyError": "lab.errors",
    "RankError": "lab.errors", "RankTimeoutError": "lab.errors",
    "Experiment": "lab.experiment", "LayoutWarning": "lab.experiment",
    "Parallel": "lab.parallel", "ParallelConfigError": "lab.parallel",
    "Plan": "lab.planner", "plan": "lab.planner",
    "connect": "lab.pool", "start": "lab.pool",
    "recommend": "lab.recommend",
    "CommTable": "lab.run_result", "NotRecordedError": "lab.run_result", "RunResult": "lab.run_result",
    "RankMapError": "lab.rank_map", "build_rank_map": "lab.rank_map",
    "Checkpoint": "lab.checkpointing", "checkpoints": "lab.checkpointing", "export": "lab.checkpointing",
    "CheckpointError": "kernels.checkpoint_files", "CheckpointMismatchError": "kernels.checkpoint_files",
    "CheckpointMissingError": "kernels.checkpoint_files",
    "compare_schedules": "lab.compare", "plot_schedules": "lab.compare",
    "Slow": "lab.faults", "Hang": "lab.faults", "Crash": "lab.faults", "Kill": "lab.faults",
    "HangError": "lab.errors", "HangReport": "lab.hang_report",
    "Training": "lab.training",
    "ParameterServer": "lab.parameter_server", "PSResult": "lab.ps_result",
}
# lab.GPT(layers=4, d_model=64, heads=4, vocab=256, seq_len=32) names the model to train
_ALIASES = {"GPT": "GPTConfig"}

__all__ = sorted([*_HOME, *_ALIASES])


def __getattr__(name: str) -> Any:
    target = _ALIASES.get(name, name)
    if target not in _HOME:
        raise AttributeError(f"module 'lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[target]), target)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
