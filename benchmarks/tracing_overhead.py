"""What pipeline tracing costs: the traced step beside the same step untraced, measured in one run.

A real-compute PP run (no synthetic costs) on the local pool: each repetition runs the
same experiment twice, once with ``trace=True`` and once without, alternating which
goes first. Tracing instruments only the last step, so the figure compared is the
last step's time (slowest rank). The pool defaults to one rank per core, so the ranks
do not time-share cores and the difference is the tracing, not the scheduler.
Goal: traced / untraced ≤ 1.03.

Run: ``python benchmarks/tracing_overhead.py [--ranks 2] [--repeats 12]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import lab

MODEL = lab.GPT(layers=8, d_model=256, heads=8, vocab=512, seq_len=64)
STEPS = 3  # the first infers the p2p shapes; the last is the one traced


def last_step(result: lab.RunResult) -> float:
    """The traced (last) step's time on the slowest rank."""
    return max(times[-1] for times in result.step_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=max(2, min(4, os.cpu_count() or 2)))
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    warnings.simplefilter("ignore", lab.OversubscribedWarning)
    layout = lab.Parallel(pp=args.ranks, schedule="1f1b", microbatches=args.microbatches)
    with lab.start(n=args.ranks, backend="gloo", activate=False) as cluster:
        runs = {flag: lab.Experiment(cluster, MODEL, layout, global_batch=4 * args.microbatches, steps=STEPS,
                                     trace=flag) for flag in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        began = time.perf_counter()
        for repeat in range(args.repeats):
            for flag in ((False, True) if repeat % 2 == 0 else (True, False)):
                times[flag].append(last_step(runs[flag].run()))
        off, on = statistics.median(times[False]), statistics.median(times[True])
        spread = statistics.pstdev(times[False]) / off
        print(f"PP{args.ranks} 1F1B m={args.microbatches}, real compute, {args.repeats} repeats "
              f"({time.perf_counter() - began:.0f} s): last step untraced {off * 1e3:.1f} ms (±{spread:.1%}), "
              f"traced {on * 1e3:.1f} ms, ratio {on / off:.3f}x (goal <= 1.03x)")


if __name__ == "__main__":
    main()
