"""The torchrun side of benchmarks/vs_torchrun.py: the same ``kernels.train.entry.train_rank``, launched by torchrun,
with nothing of the lab's watching on (the baseline a plain torchrun script sets).

Usage: ``torchrun --nproc-per-node N benchmarks/torchrun_job.py CONFIG.json OUT_PREFIX``;
each rank writes OUT_PREFIX.rank<r>.json with its records.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from kernels.train.entry import train_rank


def main() -> None:
    # What a plain torchrun script runs: the lab's own watching (the collective log, progress records) off.
    cfg = {**json.loads(open(sys.argv[1]).read()), "watch_collectives": False, "progress": False}
    torch.set_num_threads(1)  # the lab's ranks run with 1 thread each on this machine too
    dist.init_process_group("gloo")
    try:
        out = train_rank(cfg)
        with open(f"{sys.argv[2]}.rank{dist.get_rank()}.json", "w") as f:
            json.dump({"losses": out["losses"], "step_times": out["step_times"]}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
