"""What repeated Experiments leave behind on a warm pool's ranks: resident memory, threads, file descriptors.

Runs ``--runs`` tiny Experiments (one step each) on one pool, alternating the layouts given,
and prints each rank's footprint after the first run and after the last, with the growth per
run in between (the issue's bound: under 5 MiB over 50 runs).

Run: ``python benchmarks/warm_pool_memory.py [--ranks 2] [--runs 50] [--layouts tp,zero3]``
"""
from __future__ import annotations

import argparse
import warnings

import psutil

import lab

LAYOUTS = {"dp": dict(dp=2), "tp": dict(tp=2), "zero3": dict(dp=2, zero=3), "pp": dict(pp=2, microbatches=2)}


def footprint(cluster: lab.Cluster) -> list[tuple[float, int, int]]:
    """Per rank: resident MiB, threads, open file descriptors."""
    rows = []
    for row in cluster.status():
        proc = psutil.Process(row.pid)
        rows.append((row.rss_bytes / 2**20, proc.num_threads(), proc.num_fds()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--layouts", default="tp,zero3", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    warnings.simplefilter("ignore", lab.OversubscribedWarning)
    layouts = [lab.Parallel(**LAYOUTS[name]) for name in args.layouts.split(",")]
    model = lab.GPT(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)
    with lab.start(n=args.ranks, backend="gloo", activate=False) as cluster:
        for i in range(args.runs):
            lab.Experiment(cluster, model, layouts[i % len(layouts)], global_batch=4, steps=1).run()
            if i == 0:
                first = footprint(cluster)
        last = footprint(cluster)
    for rank, ((rss0, threads0, fds0), (rss, threads, fds)) in enumerate(zip(first, last)):
        per_run_kib = (rss - rss0) * 1024 / max(args.runs - 1, 1)
        print(f"rank {rank}: RSS after run 1 {rss0:.1f} MiB, after run {args.runs} {rss:.1f} MiB "
              f"(+{rss - rss0:.2f} MiB, {per_run_kib:.0f} KiB per run); threads {threads0} -> {threads}, "
              f"fds {fds0} -> {fds}")


if __name__ == "__main__":
    main()
