"""What live progress costs: step time with per-step records on beside off, measured in one run.

A real-compute DP run on the local pool: each repetition runs the same experiment
twice, ``run(progress=False)`` (the ranks send nothing, no stop flag) and
``start().wait()`` (one StepProgress per step through ipyparallel's data channel and the
async stop-flag all_reduce; both keep the collective log every Experiment run keeps),
alternating which goes first. The figure is the median step time of the slowest rank, first step left out; on a busy
machine the median of each adjacent pair's ratio and the fastest step of each mode (the
least disturbed) are printed too. The pool defaults to one rank per core, so ranks do not
time-share cores. Goal: on / off ≤ 1.03.

Run: ``python benchmarks/progress_overhead.py [--ranks 2] [--repeats 8] [--steps 12]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import lab

MODEL = lab.GPT(layers=4, d_model=128, heads=4, vocab=256, seq_len=64)


def reporter_seconds(calls: int) -> float:
    """On a rank: mean seconds of one ``step_done`` (record, publish_data, stop-flag all_reduce), real channel.

    Between calls the rank sleeps 20 ms, a step's compute, during which the async flag all_reduce finishes
    as it does in training; only the calls are timed.
    """
    import torch

    from kernels.watch.progress import engine_publisher, ProgressReporter

    class Marks:  # a finished step's clock marks, as kernels.train.train_loop.StepClock keeps them on the CPU
        marks = [[0.0, 0.01]] * calls

    reporter = ProgressReporter(calls + 1, 1024, torch.device("cpu"), publish=engine_publisher())
    loss = torch.tensor(1.0, dtype=torch.float64)
    spent = 0.0
    with reporter:
        for step in range(calls):
            time.sleep(0.02)
            began = time.perf_counter()
            reporter.step_done(step, loss, Marks)
            spent += time.perf_counter() - began
    return spent / calls


def slowest_rank(result: lab.RunResult) -> list[float]:
    """Each step's time on the slowest rank, the first step left out."""
    return [max(times[s] for times in result.step_times) for s in range(1, len(result.step_times[0]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=max(2, min(4, os.cpu_count() or 2)))
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    warnings.simplefilter("ignore", lab.OversubscribedWarning)
    with lab.start(n=args.ranks, backend="gloo", activate=False) as cluster:
        exp = lab.Experiment(cluster, MODEL, lab.Parallel(dp=args.ranks), global_batch=8 * args.ranks,
                             steps=args.steps)
        runs = {False: lambda: exp.run(progress=False), True: lambda: exp.start().wait()}
        medians: dict[bool, list[float]] = {False: [], True: []}
        fastest = {False: float("inf"), True: float("inf")}
        began = time.perf_counter()
        for repeat in range(args.repeats):
            for flag in ((False, True) if repeat % 2 == 0 else (True, False)):
                steps = slowest_rank(runs[flag]())
                medians[flag].append(statistics.median(steps))
                fastest[flag] = min(fastest[flag], *steps)
        off, on = statistics.median(medians[False]), statistics.median(medians[True])
        paired = statistics.median(b / a for a, b in zip(medians[False], medians[True]))
        spread = statistics.pstdev(medians[False]) / off
        print(f"DP{args.ranks}, {args.steps} steps, {args.repeats} repeats ({time.perf_counter() - began:.0f} s): "
              f"step without progress {off * 1e3:.2f} ms (±{spread:.1%}), with progress {on * 1e3:.2f} ms, "
              f"ratio {on / off:.3f}x (goal <= 1.03x); paired ratio {paired:.3f}x; fastest step "
              f"{fastest[False] * 1e3:.2f} ms vs {fastest[True] * 1e3:.2f} ms ({fastest[True] / fastest[False]:.3f}x)")
        cost = max(cluster.run(reporter_seconds, 200))  # the reporter alone, less exposed to a busy machine
        print(f"the reporter's own cost per step: {cost * 1e6:.0f} us on the slowest rank, "
              f"{cost / off:.2%} of a step without progress")

if __name__ == "__main__":
    main()
