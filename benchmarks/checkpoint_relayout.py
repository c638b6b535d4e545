"""A layout change that keeps the weights: ``Training.relayout`` on a warm pool against a torchrun relaunch.

The same model is trained 2 steps under DP4 and saved. Then, measured in one run on this machine:

1. ``Training.relayout(TP2×DP2 ZeRO-3)`` on the warm pool (the old layout writes its state with
   DCP to memory-backed /dev/shm, the new one is built on the same engines and reads it back),
   median of ``--repeats`` (each timed hop DP4 → TP2×DP2 follows an untimed hop back);
2. a fresh ``torchrun`` launch of ``kernels.train.entry`` under TP2×DP2 ZeRO-3 that resumes from the
   saved checkpoint and trains one step, process start to exit (what changing the layout costs
   without a warm pool), median of ``--repeats``; beside it the lab's relayout plus that one step.

Goal: at least 20× faster than the relaunch, which loads and trains one step. Two ratios are printed:
the relayout itself (the new layout holding the weights, ready to step) against the relaunch, as the
issue that set the goal measured it, and the relayout with its first step, so that both sides include
one step (a TP2×DP2 ZeRO-3 step of this model costs about 0.2 s on two cores, on either side).
``relayout_vs_torchrun`` returns the figures, for ``benchmarks/checkpoint.py`` to print with the save
and load figures.

Run: ``python benchmarks/checkpoint_relayout.py [--repeats 3]``
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
from vs_torchrun import settled

MODEL = lab.GPT(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)
OLD, NEW = lab.Parallel(dp=4), lab.Parallel(dp=2, tp=2, zero=3)
GLOBAL_BATCH = 16
JOB = Path(__file__).resolve().parent / "torchrun_job.py"


def torchrun_resume_s(cluster: lab.Cluster, checkpoint: Path) -> float:
    """Wall seconds of a torchrun launch that loads ``checkpoint`` under NEW and trains one step."""
    step = lab.checkpoints(checkpoint.parent)[-1].step
    exp = lab.Experiment(cluster, MODEL, NEW, global_batch=GLOBAL_BATCH, steps=step + 1, resume_from=checkpoint)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(exp.config()))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(NEW.world_size), str(JOB), str(config), str(Path(tmp) / "records")]
        began = time.perf_counter()
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - began


def relayout_vs_torchrun(cluster: lab.Cluster, repeats: int = 3) -> dict[str, float]:
    """Median seconds: relayout, relayout + one step, torchrun relaunch + load + one step; and both speed-ups."""
    hops, with_step = [], []
    with tempfile.TemporaryDirectory() as tmp, lab.Training(cluster, MODEL, OLD, global_batch=GLOBAL_BATCH) as training:
        training.step(2)
        checkpoint = training.save(Path(tmp) / "saved")
        for _ in range(repeats):
            began = time.perf_counter()
            training.relayout(NEW)
            hops.append(time.perf_counter() - began)
            training.step(1)
            with_step.append(time.perf_counter() - began)
            training.relayout(OLD)
        relaunch = [torchrun_resume_s(cluster, checkpoint) for _ in range(repeats)]
    out = {"relayout_s": statistics.median(hops), "relayout_and_step_s": statistics.median(with_step),
           "torchrun_resume_s": statistics.median(relaunch)}
    out["relayout_speedup"] = out["torchrun_resume_s"] / out["relayout_s"]
    out["speedup"] = out["torchrun_resume_s"] / out["relayout_and_step_s"]  # both: new layout, weights, one step
    return out


def report(figures: dict[str, float]) -> str:
    """The figures as the lines the benchmark prints."""
    return (f"DP4 -> TP2xDP2 ZeRO-3, same weights: Training.relayout {figures['relayout_s'] * 1e3:.0f} ms "
            f"(with its first step {figures['relayout_and_step_s'] * 1e3:.0f} ms); "
            "torchrun relaunch loading the checkpoint "
            f"+ one step {figures['torchrun_resume_s']:.2f} s: the relayout {figures['relayout_speedup']:.0f}x faster "
            f"(goal >= 20x), with its first step {figures['speedup']:.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with lab.start(n=4) as cluster:
        print(report(relayout_vs_torchrun(settled(cluster), args.repeats)))


if __name__ == "__main__":
    main()
