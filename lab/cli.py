"""``cluster-lab``: the command line (``demo`` runs the main job, ``info`` prints the rank table)."""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import lab
from lab.demo import check_collectives, format_rows


def _start(args: argparse.Namespace) -> lab.Cluster:
    return lab.start(n=args.ranks, backend=args.backend, timeout=args.timeout, activate=False)


def demo(args: argparse.Namespace) -> int:
    """Start the pool, run every collective, print the per-rank table and check each value."""
    began = time.perf_counter()
    with _start(args) as cluster:
        print(cluster, f"\n(pool up in {time.perf_counter() - began:.1f}s)\n")
        rows = check_collectives(cluster)
        print(format_rows(rows))
        wrong = [r for r in rows if not r["ok"]]
        print(f"\n{len(rows) - len(wrong)} of {len(rows)} collective results match the hand-computed values")
    return 1 if wrong else 0


def info(args: argparse.Namespace) -> int:
    """Start the pool, print its rank table and stop."""
    with _start(args) as cluster:
        print(cluster)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cluster-lab`` console script."""
    parser = argparse.ArgumentParser(prog="cluster-lab", description=__doc__)
    parser.add_argument("--ranks", type=int, default=None, help="ranks to start (default: one per GPU, or 4 on CPU)")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the pool")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="start the pool, run the collectives and check every result")
    sub.add_parser("info", help="print the rank table")
    args = parser.parse_args(argv)
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    return {"demo": demo, "info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
