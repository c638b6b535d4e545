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
    "bench_collectives": "lab.measure.bench",
    "Cluster": "lab.pool.cluster", "OversubscribedWarning": "lab.pool.cluster_world",
    "ConfigError": "kernels.contract.config_rules",
    "Controls": "lab.run.controls",
    "GPTConfig": "kernels.model.gpt", "LlamaConfig": "kernels.model.llama",
    "DryRunReport": "lab.planning.dry_run", "dry_run": "lab.planning.dry_run",
    "DeadRankError": "lab.errors", "LabError": "lab.errors", "PoolStoppedError": "lab.errors",
    "PoolBusyError": "lab.errors",
    "PoolStartError": "lab.pool.start_failure", "PoolStartWarning": "lab.pool.start_failure",
    "RankError": "lab.errors", "RankTimeoutError": "lab.errors",
    "Experiment": "lab.run.experiment", "LayoutWarning": "lab.run.experiment",
    "Parallel": "lab.run.parallel", "ParallelConfigError": "lab.run.parallel",
    "Plan": "lab.planning.planner", "plan": "lab.run.plan_on_pool",
    "connect": "lab.pool.start_or_connect", "start": "lab.pool.start_or_connect",
    "recommend": "lab.planning.recommend", "balance_stages": "lab.planning.stage_balance",
    "CommTable": "lab.run.comm_table", "NotRecordedError": "lab.run.run_result", "RunResult": "lab.run.run_result",
    "RankMapError": "lab.pool.rank_map", "build_rank_map": "lab.pool.rank_map",
    "Checkpoint": "lab.run.checkpointing", "checkpoints": "lab.run.checkpointing", "export": "lab.run.checkpointing",
    "CheckpointError": "kernels.checkpoint.files", "CheckpointMismatchError": "kernels.checkpoint.files",
    "CheckpointMissingError": "kernels.checkpoint.files",
    "compare_schedules": "lab.run.compare", "plot_schedules": "lab.run.compare",
    "Slow": "lab.run.faults", "Hang": "lab.run.faults", "Crash": "lab.run.faults", "Kill": "lab.run.faults",
    "PoisonBatch": "lab.run.faults", "SpikeGuard": "kernels.contract.training_hygiene",
    "WarmupCosine": "lab.run.training_hygiene", "StepLR": "lab.run.training_hygiene",
    "HangError": "lab.errors", "HangReport": "lab.pool.hang_report",
    "Training": "lab.run.training", "Model": "lab.run.own_models",
    "AutoResumeError": "lab.run.auto_resume", "RunEvent": "lab.run.events", "EventHookWarning": "lab.run.events",
    "Text": "lab.run.data_sources", "Tokens": "lab.run.data_sources", "ModularAddition": "lab.run.data_sources",
    "Batches": "lab.run.data_sources",
    "ParameterServer": "lab.ps.parameter_server", "PSResult": "lab.ps.ps_result",
}
# lab.GPT(layers=4, d_model=64, heads=4, vocab=256, seq_len=32) or
# lab.Llama(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=32) names the model to train
_ALIASES = {"GPT": "GPTConfig", "Llama": "LlamaConfig"}

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
