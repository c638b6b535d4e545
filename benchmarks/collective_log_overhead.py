"""What the collective log costs a training step: per state write, and a DP step with the log on against off.

Every run of ``lab.Experiment`` publishes each rank's collectives and actions
(``kernels.watch.rank_watch`` into ``kernels.watch.collective_log``), so that a hang can be
diagnosed while ranks are blocked. Two figures:

1. one state change (a collective's entry or exit, or an action), median over many, in
   this process: as a training rank's log makes it (the file written from the log's thread,
   at most every ``PUBLISH_EVERY_S``), beside a log that writes the file at every change;
   times the changes a DP step makes (2 per collective, 4 actions) gives the cost per step;
2. the same DP run on the pool with the log on and off, alternating which goes first;
   the median step time of steps after the first (slowest rank), on against off.

Run: ``python benchmarks/collective_log_overhead.py [--ranks 2] [--repeats 8]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import lab
from kernels.watch.collective_log import CollectiveLog
from kernels.watch.state_file import PUBLISH_EVERY_S
from kernels.train.entry import train_rank

MODEL = lab.GPT(layers=4, d_model=128, heads=4, vocab=256, seq_len=64)
STEPS = 6


def change_cost_s(publish_every_s: float | None, n: int = 20000) -> float:
    """Median seconds of one state change (an enter and a leave, halved), the log publishing as ``CollectiveLog`` is told."""
    with tempfile.TemporaryDirectory() as directory:
        log = CollectiveLog(0, os.path.join(directory, "log.bin"), publish_every_s=publish_every_s)
        log.begin_step(0)
        samples = []
        for _ in range(n):
            began = time.perf_counter()
            log.leave(log.enter("all_reduce", "dp", (0, 1, 2, 3), 1 << 20))
            samples.append((time.perf_counter() - began) / 2)
        log.close()
    return statistics.median(samples)


def step_time(per_rank: list[dict]) -> float:
    """Median over steps after the first of the slowest rank's step time."""
    return statistics.median(max(r["step_times"][s] for r in per_rank) for s in range(1, STEPS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=max(2, min(4, os.cpu_count() or 2)))
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    change_s, write_s = change_cost_s(PUBLISH_EVERY_S), change_cost_s(None)
    warnings.simplefilter("ignore", lab.OversubscribedWarning)
    with lab.start(n=args.ranks, backend="gloo", activate=False) as cluster:
        exp = lab.Experiment(cluster, MODEL, lab.Parallel(dp=args.ranks), global_batch=8 * args.ranks, steps=STEPS)
        cfgs = {flag: {**exp.config(), "watch_collectives": flag} for flag in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        collectives = 0
        for repeat in range(args.repeats):
            for flag in ((False, True) if repeat % 2 == 0 else (True, False)):
                per_rank = cluster.run(train_rank, cfgs[flag])
                times[flag].append(step_time(per_rank))
                if flag:
                    collectives = max(w["collectives"] for w in per_rank[0]["waits"][1:])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    changes = 2 * collectives + 4  # entry and exit of each collective; step, forward, backward, optimizer
    print(f"one state change: {change_s * 1e6:.2f} us as a training rank's log makes it (written every "
          f"{PUBLISH_EVERY_S * 1e3:.0f} ms from its thread), {write_s * 1e6:.1f} us written at each change; a "
          f"DP{args.ranks} step makes {changes} ({collectives} collectives): {changes * change_s * 1e6:.0f} us per step "
          f"({changes * write_s * 1e6:.0f} us written at each)")
    print(f"DP{args.ranks} step, {args.repeats} repeats: log off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, "
          f"ratio {on / off:.3f}x (spread off ±{statistics.pstdev(times[False]) / off:.1%})")


if __name__ == "__main__":
    main()
