"""How long a save holds the training up: asynchronous (``checkpoint_async=True``) against synchronous, per layout.

For DP4, ZeRO-3 DP4 and PP2×TP2 (4 CPU ranks, a GPT of ``--d-model``), one run of ``--steps`` steps
saving every ``--every`` steps, synchronously, then the same run saving asynchronously. Each rank records,
per save, the seconds its training loop waited in the save call (``save_blocked_seconds``): for a
synchronous save the whole save, for an asynchronous one the wait for the previous write (one is in flight
at a time) plus the copy to CPU memory. The figure per run is the median over its saves of the slowest
rank's wait; the first save (which allocates the staging buffers and plans) is printed apart.

On this 2-core machine the background write has no idle core: it slows the steps it overlaps, which
``benchmarks/checkpoint.py`` reports as the step-time cost. This one is what the loop itself waits for.
Goal: blocked ≤ 10% of a synchronous save.

Run: ``python benchmarks/async_checkpoint.py [--steps 30] [--every 3] [--d-model 256]``
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings

import lab
from kernels.train.entry import train_rank
from vs_torchrun import settled

LAYOUTS = {"DP4": lab.Parallel(dp=4), "ZeRO-3 DP4": lab.Parallel(dp=4, zero=3),
           "PP2×TP2": lab.Parallel(pp=2, tp=2, microbatches=2)}


def blocked(cluster: lab.Cluster, model: lab.GPT, parallel: lab.Parallel, steps: int, every: int,
            asynchronous: bool) -> tuple[float, float]:
    """(first save's, median of the later saves') seconds the slowest rank's loop waited in the save call."""
    with tempfile.TemporaryDirectory() as root:
        exp = lab.Experiment(cluster, model, parallel, global_batch=8, steps=steps, checkpoint_dir=root,
                             checkpoint_every=every, checkpoint_async=asynchronous)
        records = cluster.run(train_rank, {**exp.config(), "progress": False})
    per_save = slowest_saves(records)
    return per_save[0], statistics.median(per_save[1:])


def slowest_saves(records: list[dict]) -> list[float]:
    """Each save's wait on the slowest rank, from the rank records' ``save_blocked_seconds``."""
    return [max(waits) for waits in zip(*(r["save_blocked_seconds"] for r in records))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    model = lab.GPT(layers=4, d_model=args.d_model, heads=4, vocab=512, seq_len=32)
    print(f"save every {args.every} of {args.steps} steps, GPT d_model={args.d_model}: the slowest rank's wait "
          "in the save call, median over the saves after the first (the first apart)")
    with lab.start(n=4, backend="gloo", threads_per_rank=1, activate=False) as cluster:
        settled(cluster)
        for name, parallel in LAYOUTS.items():
            sync_first, sync_s = blocked(cluster, model, parallel, args.steps, args.every, False)
            async_first, async_s = blocked(cluster, model, parallel, args.steps, args.every, True)
            print(f"  {name}: sync {sync_s * 1e3:.1f} ms (first {sync_first * 1e3:.1f}), async blocked "
                  f"{async_s * 1e3:.1f} ms (first {async_first * 1e3:.1f}) = {async_s / sync_s:.1%} of sync "
                  "(goal <= 10%)")


if __name__ == "__main__":
    main()
