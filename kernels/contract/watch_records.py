"""What a rank publishes while it trains (``kernels.watch``): flight-recorder groups, open collectives,
its activity, the waits of each step and per-step progress.

Shapes and rules of every record: ``kernels.contract.records``. Standard library only: the widgets import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.contract.records import Record


@dataclass(frozen=True)
class FlightGroup(Record):
    """One process group as torch's flight recorder saw it on one rank (``kernels.watch.flight_recorder``)."""

    group: str  # the process group's name in c10d ("0" is the world)
    axis: str  # its mesh axis ("dp", "tp", "pp"), "" for other groups
    ranks: tuple[int, ...]  # its global ranks
    last_seq: int  # the group's sequence number of the last collective this rank entered
    last_op: str  # that collective, as c10d names it ("gloo:all_reduce", "nccl:reduce_scatter" ...)
    last_done_seq: int  # the last one that finished on this rank


@dataclass(frozen=True)
class OpenCollective(Record):
    """A collective the rank entered and has not left."""

    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv ...
    group: str  # the mesh axis it runs over ("dp", "tp", "pp"), "world", or "group"
    ranks: tuple[int, ...]  # the group's global ranks
    seq: int  # its number among this rank's collectives in that group, from 1
    nbytes: int  # payload (kernels.watch.comm's convention)
    entered: float  # time.time() at entry, so the driver on the same host can say how long it has waited
    phase: str = ""  # the traced action it was entered from (backward: a gradient sync)


@dataclass(frozen=True)
class RankActivity(Record):
    """One rank's published state: the step, the last traced action, the collectives it is inside."""

    rank: int
    pid: int
    counter: int  # grows with every update, across runs of the same process
    step: int = -1  # -1: before the first step
    action: str = "setup"  # e.g. "forward, step 3, micro-batch 1", "optimizer, step 3", "done"
    open: tuple[OpenCollective, ...] = ()
    updated: float = 0.0  # time.time() of this snapshot
    faults: tuple[str, ...] = ()  # faults injected on this rank, as they were applied
    more_open: int = 0  # open collectives beyond the MAX_OPEN oldest listed

    _nested = {"open": OpenCollective}


@dataclass(frozen=True)
class StepWait(Record):
    """One rank's step split into time inside collectives and the rest (compute, Python, the optimizer)."""

    rank: int
    step: int
    step_s: float  # from this step's batch to the next one's (the loss all-reduce included)
    wait_s: float  # inside any collective (the union of their intervals)
    grad_sync_s: float  # inside collectives entered during backward: the gradient all-reduce/reduce-scatter
    compute_s: float  # step_s - wait_s
    collectives: int  # how many collectives the rank entered in the step
    # docs/design.md#overlap-model-flops-and-mfu (kernels.watch.overlap): forward and backward windows less
    # the main thread's waits for collectives, and the part of that during which a collective was in flight
    busy_s: float = 0.0
    overlap_s: float = 0.0


@dataclass(frozen=True)
class StepProgress(Record):
    """One finished step on one rank, sent while the run goes on (``kernels.watch.progress``, ipyparallel's data channel).

    ``collective_s`` is the time the rank's main thread spent blocked waiting for
    collectives in the step (``kernels.watch.wait_clock``), ``compute_s`` the rest of ``step_s``.
    ``tokens_per_s`` is the global batch's tokens over this rank's step time.
    ``memory_kind`` says what ``memory_bytes`` is: "rss" (the process's resident memory)
    or "cuda" (tensor memory allocated on the rank's GPU).
    ``sent_at`` is the rank's wall clock (Unix seconds) when the record left.
    """

    rank: int
    step: int
    steps: int
    loss: float
    step_s: float
    tokens_per_s: float
    collective_s: float
    compute_s: float
    memory_bytes: int
    memory_kind: str
    sent_at: float
