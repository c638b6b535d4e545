"""The α–β cost of a collective: a latency per ring step plus the wire bytes over the bus bandwidth.

A ring collective on a group of n ranks runs a fixed number of steps one after another, each
paying the link's latency α before its bytes move (Thakur, Rabenseifner and Gropp, "Optimization
of collective communication operations in MPICH", 2005; docs/design.md#bus-bandwidth):

    seconds = steps(op, n) · α + wire_bytes / busbw

with steps 2(n-1) for all_reduce (a reduce-scatter then an all-gather), n-1 for all_gather,
reduce_scatter, a ring broadcast and an all-to-all (pairwise exchange), 1 for a send;
wire_bytes = payload · f and busbw the nccl-tests bus bandwidth, so the second term is the
planner's bandwidth-only time.
``fit_alpha_beta`` recovers α and busbw from a size sweep (``lab.bench_collectives``).
Pure Python; no torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lab.planning.plan_math import busbw_factor

# α per ring step, in microseconds, for the planner's default hardware (its default bandwidths are
# NVLink's and EFA's). A public estimate, not a measurement of ours: "~10 µs" for the smallest
# all-reduce inside an H100 node and "2 to 5 µs per switch hop" on InfiniBand (factryze.ai's scale
# atlas, "Tree-Reduce Latency"). 1 µs a step gives an 8-GPU all-reduce 14 µs; 5 µs a step between
# nodes is one hop plus the library's dispatch. Pass the pool's own (``lab.measure.bench.planner_links``).
DEFAULT_ALPHA_US = {"intra": 1.0, "inter": 5.0}


def collective_steps(op: str, n: int) -> int:
    """Latency steps of one ring call of ``op`` on ``n`` ranks (each pays α once); 0 when n = 1."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if n == 1:
        return 0
    op = op.lower().replace("-", "_")
    if op in ("all_reduce", "allreduce"):
        return 2 * (n - 1)
    # An all-to-all of large messages is a pairwise exchange (Thakur et al.): n-1 steps, one partner each.
    if op in ("all_gather", "allgather", "reduce_scatter", "reducescatter", "broadcast", "all_to_all", "alltoall"):
        return n - 1
    if op in ("p2p", "send", "recv", "send_recv"):
        return 1
    raise ValueError(f"unknown collective {op!r}")


def collective_seconds(op: str, n: int, payload_bytes: float, busbw: float, alpha_s: float,
                       calls: int = 1) -> float:
    """Seconds for ``calls`` calls of ``op`` on ``n`` ranks with ``payload_bytes`` each (nccl-tests' payload),
    at bus bandwidth ``busbw`` (bytes/s) and ``alpha_s`` seconds per ring step."""
    if busbw <= 0:
        return math.inf
    wire = payload_bytes * busbw_factor(op, n)
    return calls * (collective_steps(op, n) * alpha_s + wire / busbw)


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted α–β model of one collective on one link."""

    op: str
    world: int
    link: str  # "intra", "inter" or "" (the whole world)
    alpha_s: float  # seconds per ring step (collective_steps)
    busbw: float  # bytes/s: wire bytes per second once the latency is paid
    points: int  # sizes fitted
    rel_rms: float  # root-mean-square of (model − measured) / measured over the points: how well the line fits
    through_origin: bool = False  # the free fit gave α < 0, so α was fixed at 0

    def seconds(self, payload_bytes: float, calls: int = 1) -> float:
        """The model's time for ``calls`` calls of this op on this link."""
        return collective_seconds(self.op, self.world, payload_bytes, self.busbw, self.alpha_s, calls)


def fit_alpha_beta(points: Sequence[tuple[float, float]], op: str, n: int, link: str = "") -> AlphaBeta:
    """Least-squares α and busbw from (payload bytes, seconds per call) of one op on one group size.

    Each point weighs 1/t, as if a time's noise variance grew with the time itself (interruptions
    by other processes, packets queued behind others): a sweep spans sizes whose times differ a
    thousandfold, and an unweighted fit lets the noise of the largest sizes set α, which only the
    small sizes show; a relative one (1/t²) lets the small sizes set busbw, which a shaper's burst
    (a token bucket lets a few small calls through faster than its rate) then overstates by a third
    (docs/design.md#collective-latency). A negative intercept is such a burst, not a latency: α is
    then 0 and the line goes through the origin. Needs at least two distinct sizes.
    """
    f, steps = busbw_factor(op, n), collective_steps(op, n)
    xs = [payload * f for payload, _ in points]  # wire bytes
    ts = [t for _, t in points]
    if len(set(xs)) < 2 or min(ts) <= 0 or steps == 0:
        raise ValueError(f"fit_alpha_beta needs two or more sizes with positive times on n >= 2 ranks, got {points}")
    w = [1 / t for t in ts]
    sw, sx, st = sum(w), _dot(w, xs), _dot(w, ts)
    sxx, sxt = _dot(w, [x * x for x in xs]), _dot(w, [x * t for x, t in zip(xs, ts)])
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    intercept = (st - slope * sx) / sw
    origin = intercept < 0
    if origin:
        intercept, slope = 0.0, sxt / sxx
    if slope <= 0:
        raise ValueError(f"time does not grow with size in {points}: no bandwidth to fit")
    rms = math.sqrt(sum(((intercept + slope * x - t) / t) ** 2 for x, t in zip(xs, ts)) / len(ts))
    return AlphaBeta(op, n, link, intercept / steps, 1 / slope, len(ts), rms, origin)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))
