"""What each lab feature costs a training step, each measured against the same run with it off, in one run.

One layout (PP2×DP2, 4 CPU ranks, gloo, 1 thread each; a pipeline, so tracing applies), the rank entry
``kernels.train.entry.train_rank`` called on the pool with every feature off as the baseline, and each
feature turned on alone. Each figure is the median of ``--rounds`` rounds; in a round the feature's run
and the baseline's alternate, so both share the machine's drift. Per feature, the step it costs:

- progress records (``progress``): the median step (slowest rank), on against off;
- collective log with its beacon (``watch_collectives``): the median step, on against off;
- flight recorder (torch's ring of collectives, on in every pool): the median step of a second pool started
  with ``lab.start(flight_recorder=False)`` against this one, both with everything else off;
- tracing (``trace``) and memory measurement (``measure``) instrument the last step only: that step,
  on against off;
- async checkpoints (``checkpoint_async``, a save every ``--every`` steps): the median step plus the
  seconds the loop waited in the saves, spread over the steps, on against off (the background write's
  CPU shows in the steps it overlaps: on two cores it has no core of its own).

Run: ``python benchmarks/overheads.py [--steps 30] [--rounds 3] [--every 5]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable

import lab
from async_checkpoint import slowest_saves
from kernels.train.entry import train_rank
from vs_torchrun import GLOBAL_BATCH, MODEL, settled, steady_step

LAYOUT = lab.Parallel(pp=2, dp=2, microbatches=4)
OFF = {"watch_collectives": False, "progress": False, "trace": False, "measure": False, "return_params": False}


def steady(records: list[dict]) -> float:
    return steady_step([r["step_times"] for r in records])


def last_step(records: list[dict]) -> float:
    return max(r["step_times"][-1] for r in records)


def with_saves(records: list[dict]) -> float:
    return steady(records) + sum(slowest_saves(records)) / len(records[0]["step_times"])


def compare(cluster: lab.Cluster, base: dict, on: Callable[[], dict], figure: Callable[[list[dict]], float],
            rounds: int, off_cluster: lab.Cluster | None = None) -> tuple[float, float]:
    """(median figure with the feature on, median figure off), rounds alternating; ``on()`` gives each run's switches."""
    ons, offs = [], []
    for _ in range(rounds):
        ons.append(figure(cluster.run(train_rank, {**base, **on()})))
        offs.append(figure((off_cluster or cluster).run(train_rank, base)))
    return statistics.median(ons), statistics.median(offs)


def measure_all(steps: int, rounds: int, every: int) -> list[tuple[str, float, float]]:
    """(feature, seconds on, seconds off) for every feature, measured on this machine now."""
    rows = []
    with lab.start(n=4, backend="gloo", threads_per_rank=1, activate=False) as cluster, \
            tempfile.TemporaryDirectory() as root:
        settled(cluster)
        base = {**lab.Experiment(cluster, MODEL, LAYOUT, global_batch=GLOBAL_BATCH, steps=steps).config(), **OFF}
        cluster.run(train_rank, base)  # warm: the mesh, the first-call caches
        for name, switch, figure in (("progress records", {"progress": True}, steady),
                                     ("collective log and beacon", {"watch_collectives": True}, steady),
                                     ("tracing (last step)", {"trace": True}, last_step),
                                     ("memory measurement (last step)", {"measure": True}, last_step)):
            rows.append((name, *compare(cluster, base, lambda switch=switch: switch, figure, rounds)))
        rows.append((f"async checkpoints (a save every {every} steps)", *compare(
            cluster, base, lambda: {"checkpoint_dir": tempfile.mkdtemp(dir=root), "checkpoint_every": every,
                                    "checkpoint_async": True}, with_saves, rounds)))
        with lab.start(n=4, backend="gloo", threads_per_rank=1, activate=False, flight_recorder=False) as unrecorded:
            settled(unrecorded).run(train_rank, base)
            rows.append(("flight recorder", *compare(cluster, base, dict, steady, rounds, off_cluster=unrecorded)))
    return rows


def table(rows: list[tuple[str, float, float]]) -> str:
    """The figures as a Markdown table: on, off, the cost per step and the ratio."""
    lines = ["| feature | on | off | cost per step | on / off |", "|---|---|---|---|---|"]
    for name, on, off in rows:
        lines.append(f"| {name} | {on * 1e3:.1f} ms | {off * 1e3:.1f} ms | {(on - off) * 1e3:+.1f} ms | {on / off:.3f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=5, help="async checkpoints: a save every this many steps")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"PP2×DP2, 4 CPU ranks, {os.cpu_count()} cores, {args.steps} steps per run, median of {args.rounds} "
          "alternating rounds; each feature alone against everything off:")
    print(table(measure_all(args.steps, args.rounds, args.every)))


if __name__ == "__main__":
    main()
