"""How much of a step's communication was hidden behind compute: ``StepSpans``, one rank's intervals of one step.

Definition (docs/design.md#overlap-model-flops-and-mfu): with C the time the rank computed
(its forward and backward windows, less the time its main thread was blocked waiting for a
collective) and M the time some collective was in flight (from its launch to its completion,
async ones included), ``overlap = |C| + |M| − |C ∪ M|``, which is ``|C ∩ M|``. A collective
the main thread waits for right after launching it (naive data parallelism, a blocking
all-reduce) is in M but not in C, so it adds nothing: only communication that runs on the
backend's thread while the main thread computes counts.

The spans are perf_counter stamps appended by the collective log (``kernels.watch.collective_log``)
and the rank watch's module hooks (``kernels.watch.rank_watch``); the arithmetic runs once per
step, when the step closes. Torch-free.

Run alone (a forward with a collective hidden under half of it)::

    python -m kernels.watch.overlap
"""
from __future__ import annotations

Span = tuple[float, float]


def merged(spans: list[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint intervals (empty and reversed ones dropped)."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersection(a: list[Span], b: list[Span]) -> list[Span]:
    """Where two merged interval lists overlap (a merged list)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: list[Span], b: list[Span]) -> list[Span]:
    """``a`` less ``b``, both merged."""
    out: list[Span] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def total(spans: list[Span]) -> float:
    """Summed length of disjoint intervals."""
    return sum(end - start for start, end in spans)


class StepSpans:
    """One rank's compute windows, blocked waits and collectives in flight, since the last ``close``."""

    def __init__(self) -> None:
        self.compute: list[Span] = []  # forward and backward windows
        self.blocked: list[Span] = []  # the main thread waiting for a collective
        self.comm: list[Span] = []  # collectives, launch to completion

    def close(self, began: float, ended: float, still_open: list[float] | tuple[float, ...] = ()) -> tuple[float, float]:
        """(compute seconds, overlapped seconds) inside [began, ended]; starts the next step's lists.

        ``still_open``: launch times of collectives not completed yet, in flight until ``ended``.
        """
        window = [(began, ended)]
        comm = intersection(merged(self.comm + [(t, ended) for t in still_open]), window)
        busy = difference(intersection(merged(self.compute), window), merged(self.blocked))
        self.compute, self.blocked, self.comm = [], [], []
        return total(busy), total(intersection(busy, comm))


if __name__ == "__main__":
    spans = StepSpans()
    spans.compute.append((0.0, 1.0))  # a forward of one second
    spans.comm.append((0.5, 1.5))  # an all-gather launched half way, done after the forward
    spans.blocked.append((1.0, 1.5))  # then waited for
    print("compute %.2f s, overlapped %.2f s" % spans.close(0.0, 2.0))
