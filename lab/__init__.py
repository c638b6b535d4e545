"""Cluster Lab: learn and test distributed training on real torch.distributed ranks.

Start here::

    import lab
    cluster = lab.start()        # one rank per GPU (NCCL), or 4 CPU ranks (gloo)
    cluster.run(fn, *args)       # runs fn on every rank; results indexed by rank
"""
from lab._shadow_guard import check_own_packages

check_own_packages()

from lab.bench import bench_collectives  # noqa: E402
from lab.cluster import Cluster, OversubscribedWarning  # noqa: E402
from lab.controls import Controls  # noqa: E402
from kernels.model import GPTConfig  # noqa: E402
from lab.dry_run import DryRunReport, dry_run  # noqa: E402
from lab.errors import DeadRankError, LabError, PoolStoppedError, RankError, RankTimeoutError  # noqa: E402
from lab.experiment import Experiment, LayoutWarning  # noqa: E402
from lab.parallel import Parallel, ParallelConfigError  # noqa: E402
from lab.planner import Plan, plan  # noqa: E402
from lab.pool import connect, start  # noqa: E402
from lab.recommend import recommend  # noqa: E402
from lab.run_result import CommTable, NotRecordedError, RunResult  # noqa: E402

GPT = GPTConfig  # lab.GPT(layers=4, d_model=64, heads=4, vocab=256, seq_len=32) names the model to train
from lab.rank_map import RankMapError, build_rank_map  # noqa: E402

__all__ = [
    "Cluster", "CommTable", "Controls", "DeadRankError", "DryRunReport", "Experiment", "GPT", "GPTConfig", "LayoutWarning", "NotRecordedError", "RunResult", "LabError", "OversubscribedWarning", "Parallel", "ParallelConfigError", "Plan",
    "PoolStoppedError", "RankError", "RankMapError", "RankTimeoutError", "bench_collectives", "build_rank_map", "connect", "dry_run", "plan",
    "recommend", "start",
]
