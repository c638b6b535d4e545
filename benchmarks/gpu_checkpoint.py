"""One GPU: what an asynchronous checkpoint costs the training, against the same run without saves, in one run.

The lab's one NCCL rank (``lab.start(n=1)``) trains a GPT (``--layers``/``--d-model``, vocabulary
32768, bf16 autocast) for ``--steps`` steps three times: without checkpoints (the baseline),
saving every ``--every`` steps with ``checkpoint_async=True``, and saving synchronously. Per run
it prints what the training loop paid: its step clocks plus its waits in the save calls
(``save_blocked_seconds``), against the baseline's step clocks, as a share: the step-time cost.
The background write of an async save runs on the host's idle cores while the GPU computes,
so here, unlike on a 2-core machine, the steps it overlaps need not slow down.
Each run's whole wall time, which ends with the wait for its last write, is printed beside it.
Goal: async cost ≤ 5% of the steps.

Without a GPU it measures nothing, says so, and exits 0.

Run: ``python benchmarks/gpu_checkpoint.py [--steps 120] [--every 40] [--layers 4] [--d-model 512]``
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

import lab
from kernels.train.entry import train_rank


def loop_seconds(cluster: lab.Cluster, exp: lab.Experiment) -> tuple[float, list[float], float]:
    """(the loop's step clocks plus save waits, the waits per save, the run's wall seconds) of one run of ``exp``."""
    began = time.perf_counter()
    record, = cluster.run(train_rank, {**exp.config(), "progress": False})
    wall = time.perf_counter() - began
    waits = list(record["save_blocked_seconds"])
    return sum(record["step_times"]) + sum(waits), waits, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checkpoint: no CUDA GPU is visible, so nothing was measured (run it on a GPU machine)")
        return 0
    model = lab.GPT(layers=args.layers, d_model=args.d_model, heads=8, vocab=32768, seq_len=512)
    with lab.start(n=1, activate=False) as cluster, tempfile.TemporaryDirectory(prefix="gpu-ckpt-") as root:
        def experiment(**saves) -> lab.Experiment:
            return lab.Experiment(cluster, model, lab.Parallel(mixed_precision="bf16"), global_batch=args.batch,
                                  steps=args.steps, lr=1e-4, **saves)

        experiment().run()  # compiles CUDA kernels and warms the allocator: not measured
        base, _, base_wall = loop_seconds(cluster, experiment())
        print(f"GPU {torch.cuda.get_device_name(0)}, {cluster.rank_map.ranks[0].device}, backend {cluster.backend}; "
              f"GPT layers={args.layers} d_model={args.d_model}, {args.steps} steps, a save every {args.every}")
        print(f"  no saves: {base / args.steps * 1e3:.2f} ms per step (run wall {base_wall:.2f} s)")
        for name, asynchronous in (("async", True), ("sync", False)):
            exp = experiment(checkpoint_dir=f"{root}/{name}", checkpoint_every=args.every,
                             checkpoint_async=asynchronous)
            paid, waits, wall = loop_seconds(cluster, exp)
            print(f"  {name} saves: {paid / args.steps * 1e3:.2f} ms per step, cost {paid / base - 1:+.1%} of the "
                  f"steps; per save the loop waited {', '.join(f'{w * 1e3:.1f}' for w in waits)} ms "
                  f"(run wall {wall:.2f} s, with the last write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
