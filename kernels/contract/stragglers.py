"""Which ranks are stragglers: the one rule behind ``RunResult.stragglers()`` and the training dashboard.

A straggler is a rank whose *own compute* (a step's time less its time waiting in
collectives, as ``kernels.watch`` counts it) stands out from the rest. Its peers wait for
it, so their step times grow as much as its own: step time cannot tell who is slow,
compute can, once every wait is counted (docs/design.md#watching-ranks).

Rule, on each rank's typical compute (``typical``: the median over its recent steps,
the run's first step left out when there are later ones, as it pays one-off setup):
sort the ranks from slowest, and cut the list where one rank is at least ``RATIO``
times the next; the ranks above the widest such cut are the stragglers, as long as
fewer than half the ranks are above it (the majority sets the norm; with two ranks, the
slower one). A gap, not a threshold over the median, so that a peer whose waiting is
partly uncounted (a wait inside C++ no hook sees) is not named beside the rank it waits
for, and jitter among equal ranks names nobody.

Standard library only: the widgets import it.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

RATIO = 1.25  # a straggler computes at least this many times as long as the next rank below the cut
RECENT = 5  # a rank's typical figures are taken over its last this many steps


def kept_steps(steps: Iterable[int]) -> list[int]:
    """The steps a rank's typical figures come from: its last ``RECENT``, its first left out if it has later ones."""
    ordered = sorted(set(steps))
    return (ordered[1:] if len(ordered) > 1 else ordered)[-RECENT:]


def typical(by_step: Mapping[int, float]) -> float:
    """The median of ``by_step``'s values over ``kept_steps`` (0.0 when there are none)."""
    kept = kept_steps(by_step)
    return statistics.median(by_step[s] for s in kept) if kept else 0.0


def typical_per_rank(rows: Iterable[tuple[int, int, float]]) -> dict[int, float]:
    """``{rank: typical value}`` from ``(rank, step, value)`` rows (a later row for the same step wins)."""
    by_rank: dict[int, dict[int, float]] = {}
    for rank, step, value in rows:
        by_rank.setdefault(rank, {})[step] = value
    return {rank: typical(by_step) for rank, by_step in sorted(by_rank.items())}


def stragglers(compute: Mapping[int, float], ratio: float = RATIO) -> list[int]:
    """The ranks whose typical compute stands out (module docstring), in rank order; [] when none does."""
    order = sorted(compute, key=lambda r: compute[r], reverse=True)
    if len(order) < 2:
        return []
    best_k, best_gap = 0, 0.0
    for k in range(1, max(1, (len(order) - 1) // 2) + 1):  # k ranks above the cut, fewer than half
        above, below = compute[order[k - 1]], compute[order[k]]
        gap = above / below if below > 0 else (float("inf") if above > 0 else 0.0)
        if gap > best_gap:
            best_k, best_gap = k, gap
    return sorted(order[:best_k]) if best_gap >= ratio else []
