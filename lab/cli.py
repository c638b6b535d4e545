"""cluster-lab: the command line (demo runs the main job, info prints the rank table)."""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import TYPE_CHECKING, NoReturn

# torch and the pool are imported inside the commands: `cluster-lab --help` and a bad
# command line answer at once instead of after torch's import.
if TYPE_CHECKING:
    from lab.pool.cluster import Cluster

DESCRIPTION = ("Start a pool of torch.distributed ranks and check it: 'demo' runs every collective against "
               "hand-computed values, then trains a GPT beside one process; 'info' prints the rank table.")


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported in one line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (cluster-lab --help lists the options)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def _add_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The options every command takes. The commands' copies default to SUPPRESS, so that
    ``--ranks 2 demo`` keeps the 2 that the top-level parser read."""
    default = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--ranks", type=_positive_int, default=default(None), metavar="N",
                        help="ranks to start (default: one per GPU, or 4 on CPU)")
    parser.add_argument("--backend", default=default("auto"), choices=("auto", "nccl", "gloo"),
                        help="auto: NCCL when every rank has its own GPU, else gloo")
    parser.add_argument("--timeout", type=_positive_float, default=default(120.0), metavar="SECONDS",
                        help="seconds to wait for the pool (default: 120)")
    parser.add_argument("--train-ranks", type=_positive_int, default=default(None), metavar="N",
                        help="ranks for the training part of demo (default: --ranks when given, else one per "
                             "GPU, or 8 CPU ranks for PP2×DP2×TP2)")


def build_parser() -> argparse.ArgumentParser:
    """The cluster-lab parser: options may come before or after the command."""
    parser = _Parser(prog="cluster-lab", description=DESCRIPTION)
    _add_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="{demo,info}")
    for name, text in (("demo", "run every collective and check each result, then train the GPT beside one process"),
                       ("info", "print the rank table")):
        _add_options(sub.add_parser(name, help=text, description=text), top=False)
    return parser


def _start(args: argparse.Namespace, ranks: int | None) -> Cluster:
    import lab

    try:
        return lab.start(n=ranks, backend=args.backend, timeout=args.timeout, activate=False)
    except ValueError as err:  # the pool refused the options, e.g. --backend nccl without a GPU per rank
        print(f"cluster-lab: error: {err}", file=sys.stderr)
        sys.exit(2)


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def demo(args: argparse.Namespace) -> int:
    """Part 1: every collective checked by hand. Part 2: a GPT trained in 3D beside one process."""
    from lab.demo import check_collectives, format_rows, train_demo

    train_ranks = args.train_ranks or args.ranks or _default_train_ranks()
    began = time.perf_counter()
    with _start(args, args.ranks) as cluster:
        print(cluster, f"\n(pool up in {time.perf_counter() - began:.1f}s)\n")
        print(f"the five collectives on {_ranks(cluster.world_size)}:")
        rows = check_collectives(cluster)
        print(format_rows(rows))
        wrong = [r for r in rows if not r["ok"]]
        print(f"\n{len(rows) - len(wrong)} of {len(rows)} collective results match the hand-computed values\n")
        if train_ranks != cluster.world_size:
            cluster.stop()
            cluster = _start(args, train_ranks)
        with cluster:
            parallel, result, reference = train_demo(cluster)
            print(f"training the GPT with {parallel.describe()} on {_ranks(cluster.world_size)}, "
                  f"beside the same training in one process:\n{result.loss_table(reference)}")
            same = result.matches(reference)
            print("losses equal the one-process reference" if same else "LOSSES DIFFER from the reference")
    return 1 if wrong or not same else 0


def info(args: argparse.Namespace) -> int:
    """Start the pool, print its rank table and stop."""
    with _start(args, args.ranks) as cluster:
        print(cluster)
    return 0


def _default_train_ranks() -> int:
    # CPU ranks are cheap to oversubscribe, so the demo shows a full 3D layout (PP2×DP2×TP2);
    # NCCL needs a GPU per rank, so on a GPU machine it trains on one rank per GPU.
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def main(argv: list[str] | None = None) -> int:
    """Entry point of the cluster-lab console script."""
    parser = build_parser()
    # parse_known_args, so that a stray flag is named even when the command is missing too.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error("choose a command: demo or info")
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    return {"demo": demo, "info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
