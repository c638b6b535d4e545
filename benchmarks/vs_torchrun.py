"""The lab against torchrun, on the same layouts, measured in one run on this machine.

For PP2×DP2, TP2×DP2 (ZeRO-3), ZeRO-3 DP4 and PP2×TP2 (4 CPU ranks, gloo, 1 thread each):

1. Steady-state step time: the median over steps (after warm-up) of the slowest rank's step
   time, through ``lab.Experiment.run`` on a warm pool vs the same ``kernels.train.entry`` under
   ``torchrun``. Each figure is the median of ``--rounds`` rounds; a round runs the lab as it runs by
   default (watched, with progress records), the lab unwatched (``Experiment(watch=False)``,
   ``run(progress=False)``: no collective log, no progress records) and torchrun, so the three
   alternate and share the machine's drift; each goes first in turn (round r starts with the r-th), so
   that an effect of the order falls on each alike. The lab's overhead is split by source: its watching
   (watched minus unwatched) and the engine process with the driver (unwatched minus torchrun).
   Each round also relaunches torchrun a second time: the median of those against the first is what
   the same job reads against itself, the resolution of the ratios on this machine. Goal: ≤ 1.02×.
2. Time from "new Parallel settings" to "first step done": a one-step ``Experiment.run`` on the
   warm pool right after a run under another layout, vs a fresh ``torchrun`` launch of the same
   one-step job, process start to exit; once for a layout the pool ran before (its mesh kept warm,
   ``kernels.parallel.warm_meshes``), once after the pool let go of every kept mesh, as for a layout it
   never ran; each figure the median of ``--rounds`` such pairs (lab, then relaunch). Goal: the lab at
   least 20× faster.

Run: ``python benchmarks/vs_torchrun.py [--steps 30] [--rounds 3]``
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
from kernels.parallel import warm_meshes
from lab.pool.start_or_connect import default_spare_engines

MODEL = lab.GPT(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)
LAYOUTS = {"PP2×DP2": lab.Parallel(pp=2, dp=2, microbatches=4),
           "TP2×DP2 ZeRO-3": lab.Parallel(tp=2, dp=2, zero=3),
           "ZeRO-3 DP4": lab.Parallel(dp=4, zero=3),
           "PP2×TP2": lab.Parallel(pp=2, tp=2, microbatches=4)}
GLOBAL_BATCH, WARMUP = 16, 5
JOB = Path(__file__).resolve().parent / "torchrun_job.py"


def settled(cluster: lab.Cluster, wait_s: float = 60.0) -> lab.Cluster:
    """``cluster`` once its spare engine is warmed: the spare's start (Python, ipyparallel, torch's import; about
    2 s of CPU) runs beside the first runs otherwise, and on two cores shows in whatever they measure."""
    deadline = time.monotonic() + wait_s
    while cluster.spares() < default_spare_engines() and time.monotonic() < deadline:
        time.sleep(0.25)
    return cluster


def steady_step(step_times: list[list[float]], warmup: int = WARMUP) -> float:
    """Median over steady steps of the slowest rank's time."""
    per_step = [max(rank[s] for rank in step_times) for s in range(warmup, len(step_times[0]))]
    return statistics.median(per_step)


def run_torchrun(exp: lab.Experiment) -> tuple[float, list[list[float]]]:
    """Launch torchrun on the experiment's exact config; return (wall seconds, per-rank step times)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(exp.config()))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(exp.parallel.world_size), str(JOB), str(config), str(Path(tmp) / "records")]
        began = time.perf_counter()
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - began
        ranks = sorted(Path(tmp).glob("records.rank*.json"), key=lambda p: int(p.stem.split("rank")[-1]))
        return wall, [json.loads(p.read_text())["step_times"] for p in ranks]


def steady(cluster: lab.Cluster, name: str, steps: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` alternating rounds of the steady step: the lab as it runs by default, the lab
    unwatched (no collective log, no progress records), and torchrun."""
    exp = lab.Experiment(cluster, MODEL, LAYOUTS[name], global_batch=GLOBAL_BATCH, steps=steps)
    bare = lab.Experiment(cluster, MODEL, LAYOUTS[name], global_batch=GLOBAL_BATCH, steps=steps, watch=False)
    runs = [("lab", lambda: exp.run().step_times), ("bare", lambda: bare.run(progress=False).step_times),
            ("torchrun", lambda: run_torchrun(exp)[1])]
    figures: dict[str, list[float]] = {"lab": [], "bare": [], "torchrun": [], "torchrun again": []}
    for r in range(rounds):
        for name, run in runs[r % 3:] + runs[:r % 3]:  # each goes first in turn, so an order effect cancels
            figures[name].append(steady_step(run()))
        figures["torchrun again"].append(steady_step(run_torchrun(exp)[1]))
    return {k: statistics.median(v) for k, v in figures.items()}


def first_step(cluster: lab.Cluster, name: str, cold: bool) -> tuple[float, float]:
    """(lab seconds from new settings to the first step done on the warm pool, torchrun relaunch seconds).

    ``cold``: the pool first lets go of every mesh it keeps warm (``kernels.parallel.warm_meshes``), as for a
    layout it never ran; else the layout runs one step on the pool first, then the previous layout.
    """
    previous = next(p for n, p in LAYOUTS.items() if n != name)  # the settings really change
    if not cold:  # it ran here before (an earlier case's cold measurement may have let its mesh go)
        lab.Experiment(cluster, MODEL, LAYOUTS[name], global_batch=GLOBAL_BATCH, steps=1).run(progress=False)
    lab.Experiment(cluster, MODEL, previous, global_batch=GLOBAL_BATCH, steps=1).run(progress=False)
    if cold:
        cluster.run(warm_meshes.release_all)
    began = time.perf_counter()
    one_step = lab.Experiment(cluster, MODEL, LAYOUTS[name], global_batch=GLOBAL_BATCH, steps=1)
    one_step.run()
    return time.perf_counter() - began, run_torchrun(one_step)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("steady", "first"), help="one part of the benchmark")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with lab.start(n=4, backend="gloo", threads_per_rank=1, activate=False) as cluster:
        settled(cluster)
        if args.only != "first":
            print(f"steady step, median of {args.rounds} alternating rounds of {args.steps} steps "
                  f"(warm-up {WARMUP}), slowest rank, 1 thread per rank:")
            for name in LAYOUTS:
                f = steady(cluster, name, args.steps, args.rounds)
                watching, engine = f["lab"] - f["bare"], f["bare"] - f["torchrun"]
                print(f"  {name}: lab {f['lab'] * 1e3:.1f} ms ({f['lab'] / f['torchrun']:.3f}x), lab unwatched "
                      f"{f['bare'] * 1e3:.1f} ms ({f['bare'] / f['torchrun']:.3f}x), torchrun "
                      f"{f['torchrun'] * 1e3:.1f} ms (goal <= 1.02x); overhead by source: the lab's watching "
                      f"(collective log, beacon, progress records) {watching * 1e3:+.1f} ms, the engine process "
                      f"and the driver {engine * 1e3:+.1f} ms (benchmarks/overheads.py splits the watching); torchrun "
                      f"against itself {f['torchrun again'] / f['torchrun']:.3f}x (this machine's noise at this median)")
        if args.only != "steady":
            print("new settings -> first step done (the pool last ran another layout):")
            for name in LAYOUTS:
                for cold in (False, True):
                    pairs = [first_step(cluster, name, cold) for _ in range(args.rounds)]  # lab and relaunch alternate
                    lab_s, relaunch_s = (statistics.median(p[i] for p in pairs) for i in (0, 1))
                    kind = "never run on this pool" if cold else "run on this pool before"
                    spread = ", ".join(f"{p[0]:.2f}" for p in pairs)
                    print(f"  {name} ({kind}): lab {lab_s:.2f} s ({spread}), torchrun relaunch {relaunch_s:.2f} s, "
                          f"lab {relaunch_s / lab_s:.1f}x faster (goal >= 20x; medians of {args.rounds})")


if __name__ == "__main__":
    main()
