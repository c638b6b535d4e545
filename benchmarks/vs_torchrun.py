"""The lab against torchrun, on the same layouts, measured in one run on this machine.

For PP2×DP2 and TP2×DP2 (4 CPU ranks, gloo):

1. Steady-state step time: median over steps (after warm-up) of the slowest rank's
   step time, through ``lab.Experiment.run`` on a warm pool vs the same
   ``kernels.train.entry`` under ``torchrun`` (goal: lab ≤ 1.05×), twice: each tool with its
   own thread default (the lab's ``threads_per_rank``, torchrun's ``OMP_NUM_THREADS``),
   and both with cores // 4 threads per rank (the same run again where that is 1).
2. Time from "new Parallel settings" to "first step done": a one-step
   ``Experiment.run`` on the warm pool vs a fresh ``torchrun`` launch of the same
   one-step job, process start to exit (goal: the lab at least 10× faster).

Run: ``python benchmarks/vs_torchrun.py [--steps 30]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lab

MODEL = lab.GPT(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)
LAYOUTS = {"PP2×DP2": lab.Parallel(pp=2, dp=2, microbatches=4), "TP2×DP2": lab.Parallel(tp=2, dp=2, zero=3)}
GLOBAL_BATCH, WARMUP = 16, 5
JOB = Path(__file__).resolve().parent / "torchrun_job.py"


def steady_step(step_times: list[list[float]], warmup: int = WARMUP) -> float:
    """Median over steady steps of the slowest rank's time."""
    per_step = [max(rank[s] for rank in step_times) for s in range(warmup, len(step_times[0]))]
    return statistics.median(per_step)


def run_torchrun(exp: lab.Experiment, threads: int | None = None) -> tuple[float, list[list[float]]]:
    """Launch torchrun on the experiment's exact config; return (wall seconds, per-rank step times).

    ``threads`` sets OMP_NUM_THREADS; None leaves torchrun's own default (it sets 1 per process).
    """
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(exp.config()))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(exp.parallel.world_size), str(JOB), str(config), str(Path(tmp) / "records")]
        began = time.perf_counter()
        subprocess.run(command, check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - began
        ranks = sorted(Path(tmp).glob("records.rank*.json"), key=lambda p: int(p.stem.split("rank")[-1]))
        return wall, [json.loads(p.read_text())["step_times"] for p in ranks]


def compare_steady(cluster: lab.Cluster, steps: int, label: str, torchrun_threads: int | None) -> None:
    """Print the lab's and torchrun's steady step for each layout, torchrun with ``torchrun_threads``."""
    for name, parallel in LAYOUTS.items():
        exp = lab.Experiment(cluster, MODEL, parallel, global_batch=GLOBAL_BATCH, steps=steps)
        lab_step = steady_step(exp.run().step_times)
        raw_step = steady_step(run_torchrun(exp, torchrun_threads)[1])
        print(f"{name} steady step, {label}: lab {lab_step * 1e3:.2f} ms, torchrun {raw_step * 1e3:.2f} ms, "
              f"ratio {lab_step / raw_step:.2f}x (goal <= 1.05x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    equal = max(1, (os.cpu_count() or 1) // 4)
    if equal > 1:
        with lab.start(n=4, backend="gloo", threads_per_rank=equal, activate=False) as cluster:
            compare_steady(cluster, args.steps, f"equal threads ({equal} per rank)", equal)
    with lab.start(n=4, backend="gloo", activate=False) as cluster:
        compare_steady(cluster, args.steps, f"defaults (lab {cluster.threads}, torchrun its own)", None)
        if equal == 1:
            print(f"equal threads: {os.cpu_count()} cores // 4 ranks = 1 per rank, the defaults' run above")
        for name, parallel in LAYOUTS.items():
            # The settings really change: the pool last ran the other layout.
            previous = next(p for n, p in LAYOUTS.items() if n != name)
            lab.Experiment(cluster, MODEL, previous, global_batch=GLOBAL_BATCH, steps=1).run()
            began = time.perf_counter()
            one_step = lab.Experiment(cluster, MODEL, parallel, global_batch=GLOBAL_BATCH, steps=1)
            one_step.run()
            lab_first = time.perf_counter() - began
            torchrun_first, _ = run_torchrun(one_step)
            print(f"{name} new settings -> first step done: lab {lab_first:.2f} s on the warm pool, "
                  f"torchrun relaunch {torchrun_first:.2f} s, lab {torchrun_first / lab_first:.1f}x faster (goal >= 10x)")


if __name__ == "__main__":
    main()
