"""``cluster-lab``: the command line (``demo`` runs the main job, ``info`` prints the rank table)."""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import lab
from lab.demo import check_collectives, format_rows, train_demo


def _start(args: argparse.Namespace) -> lab.Cluster:
    return lab.start(n=args.ranks, backend=args.backend, timeout=args.timeout, activate=False)


def demo(args: argparse.Namespace) -> int:
    """Part 1: every collective checked by hand. Part 2: a GPT trained in 3D beside one process."""
    began = time.perf_counter()
    with _start(args) as cluster:
        print(cluster, f"\n(pool up in {time.perf_counter() - began:.1f}s)\n")
        rows = check_collectives(cluster)
        print(format_rows(rows))
        wrong = [r for r in rows if not r["ok"]]
        print(f"\n{len(rows) - len(wrong)} of {len(rows)} collective results match the hand-computed values\n")
        if args.train_ranks != cluster.world_size:
            cluster.stop()
            cluster = lab.start(n=args.train_ranks, backend=args.backend, timeout=args.timeout, activate=False)
        with cluster:
            parallel, result, reference = train_demo(cluster)
            print(f"training the GPT with {parallel.describe()} on {cluster.world_size} rank{'s' if cluster.world_size > 1 else ''}, "
                  f"beside the same training in one process:\n{result.loss_table(reference)}")
            same = result.matches(reference)
            print("losses equal the one-process reference" if same else "LOSSES DIFFER from the reference")
    return 1 if wrong or not same else 0


def info(args: argparse.Namespace) -> int:
    """Start the pool, print its rank table and stop."""
    with _start(args) as cluster:
        print(cluster)
    return 0


def _default_train_ranks() -> int:
    # CPU ranks are cheap to oversubscribe, so the demo shows a full 3D layout (PP2×DP2×TP2);
    # NCCL needs a GPU per rank, so on a GPU machine it trains on one rank per GPU.
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cluster-lab`` console script."""
    parser = argparse.ArgumentParser(prog="cluster-lab", description=__doc__)
    parser.add_argument("--ranks", type=int, default=None, help="ranks to start (default: one per GPU, or 4 on CPU)")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the pool")
    parser.add_argument("--train-ranks", type=int, default=None,
                        help="ranks for the training part of demo (default: one per GPU, or 8 CPU ranks for "
                             "PP2×DP2×TP2)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="start the pool, run the collectives and check every result")
    sub.add_parser("info", help="print the rank table")
    args = parser.parse_args(argv)
    if args.train_ranks is None:
        args.train_ranks = _default_train_ranks()
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    return {"demo": demo, "info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
