"""Soak: many short Experiments, failures and relayouts on one warm pool; does anything grow or stay behind?

On one pool, ``--runs`` short Experiments (two steps each) are mixed with ``--failures``
failing ones (in turn: a rank raises, a rank kills its engine, a rank hangs and
``hang_after`` names it, a rank hangs past ``timeout``) and ``--relayouts`` live
re-layouts of a held ``Training`` (dp -> tp x dp -> dp). It prints:

- the driver's and the ranks' resident memory, threads and open file descriptors at the
  start and at the end;
- memory growth per run, a least-squares slope over the last ``--tail`` plain runs (the
  goal: at most 0.05 MiB per run); the ranks' figure is their median, since a killed
  rank's replacement starts afresh;
- how long each kind of failure took to be named (from the call to the raised error);
- the lab's processes left once the pool is stopped (the goal: none).

Run: ``python benchmarks/soak.py [--ranks 4] [--runs 200] [--failures 40] [--relayouts 20] [--tail 150]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import psutil

import lab

MODEL = lab.GPT(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)
MIB = 2**20


def footprint(pids: list[int]) -> tuple[float, int, int]:
    """Resident MiB, threads and open file descriptors of these processes, summed."""
    procs = [psutil.Process(p) for p in pids]
    return (sum(p.memory_info().rss for p in procs) / MIB, sum(p.num_threads() for p in procs),
            sum(p.num_fds() for p in procs))


def rank_rss_median(cluster: lab.Cluster) -> float:
    """Median resident MiB of the ranks' engines."""
    return statistics.median(row.rss_bytes / MIB for row in cluster.status())


def slope(values: list[float]) -> float:
    """Least-squares growth per step of ``values`` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))


def failing_run(cluster: lab.Cluster, kind: str, ranks: int) -> float:
    """One Experiment that fails as ``kind`` says; seconds from the call until its error was raised."""
    victim = ranks - 1
    fault = {"raise": lab.Crash(victim, at_step=1), "kill": lab.Kill(victim, at_step=1),
             "hang": lab.Hang(victim, at_step=1), "timeout": lab.Hang(victim, at_step=1)}[kind]
    expected = {"raise": lab.RankError, "kill": lab.DeadRankError, "hang": lab.HangError,
                "timeout": lab.RankTimeoutError}[kind]
    exp = lab.Experiment(cluster, MODEL, lab.Parallel(dp=ranks), global_batch=ranks, steps=3, faults=[fault],
                         hang_after=2.0 if kind == "hang" else None)
    began = time.monotonic()
    try:
        exp.run(progress=False, timeout=4.0 if kind == "timeout" else None)
    except expected:
        return time.monotonic() - began
    raise AssertionError(f"the {kind} failure was not raised as {expected.__name__}")


def relayout(cluster: lab.Cluster, ranks: int) -> None:
    """A held Training stepped, re-laid out to tp x dp and back, stepped again, closed."""
    with lab.Training(cluster, MODEL, lab.Parallel(dp=ranks), global_batch=ranks) as training:
        training.step(1)
        training.relayout(lab.Parallel(tp=2, dp=ranks // 2))
        training.step(1)
        training.relayout(lab.Parallel(dp=ranks))
        training.step(1)


def schedule(runs: int, failures: int, relayouts: int) -> list[str]:
    """Plain runs with the failures (kinds in turn) and the relayouts spread evenly among them."""
    kinds = ["raise", "kill", "hang", "timeout"]
    events = sorted([((i + 1) / (failures + 1), kinds[i % len(kinds)]) for i in range(failures)]
                    + [((j + 0.5) / relayouts, "relayout") for j in range(relayouts)])
    plan = ["run"] * runs
    for n, (where, item) in enumerate(events):
        plan.insert(int(where * runs) + n, item)
    return plan


def leftovers(driver: int, seen: set[int]) -> list[int]:
    """Lab processes of this driver still running (not zombies)."""
    alive = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if proc.pid in seen or ("kernels.engine.driver_watch" in cmd and str(driver) in cmd):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
            except psutil.NoSuchProcess:
                pass
    return alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--failures", type=int, default=40)
    parser.add_argument("--relayouts", type=int, default=20)
    parser.add_argument("--tail", type=int, default=150, help="plain runs the growth per run is measured over")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    me = psutil.Process()
    plan = schedule(args.runs, args.failures, args.relayouts)
    cluster = lab.start(n=args.ranks, backend="gloo", activate=False, spare_engines=1, timeout=120)
    seen: set[int] = set()
    driver_rss: list[float] = []
    ranks_rss: list[float] = []
    named: dict[str, list[float]] = {}
    began = time.monotonic()
    try:
        for i, item in enumerate(plan):
            if item == "run":
                lab.Experiment(cluster, MODEL, lab.Parallel(dp=args.ranks), global_batch=args.ranks,
                               steps=2).run(progress=False)
                driver_rss.append(me.memory_info().rss / MIB)
                ranks_rss.append(rank_rss_median(cluster))
            elif item == "relayout":
                relayout(cluster, args.ranks)
            else:
                named.setdefault(item, []).append(failing_run(cluster, item, args.ranks))
            if i == 0:
                start = (footprint([me.pid]), footprint([r.pid for r in cluster.rank_map.ranks]))
            seen |= cluster.pids
        end = (footprint([me.pid]), footprint([r.pid for r in cluster.rank_map.ranks]))
    finally:
        seen |= cluster.pids
        cluster.stop()
    took = time.monotonic() - began
    time.sleep(1)
    left = leftovers(os.getpid(), seen)
    print(f"{len(plan)} items on one {args.ranks}-rank pool in {took:.0f} s: {args.runs} runs, "
          f"{args.failures} failures, {args.relayouts} relayouts")
    for who, (s, e) in (("driver", (start[0], end[0])), (f"{args.ranks} ranks", (start[1], end[1]))):
        print(f"{who}: RSS {s[0]:.1f} -> {e[0]:.1f} MiB, threads {s[1]} -> {e[1]}, fds {s[2]} -> {e[2]}")
    tail = min(args.tail, len(driver_rss))
    print(f"growth per run over the last {tail} runs: driver {slope(driver_rss[-tail:]):+.4f} MiB, "
          f"rank (median) {slope(ranks_rss[-tail:]):+.4f} MiB")
    for kind, times in named.items():
        print(f"{kind}: named after {min(times):.2f}-{max(times):.2f} s (median {statistics.median(times):.2f} s, "
              f"{len(times)} times)")
    print(f"lab processes left after stop: {len(left)}")


if __name__ == "__main__":
    main()
