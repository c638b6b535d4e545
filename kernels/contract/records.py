"""Plain records that cross the lines between ranks, driver and views: defined here, once.

Every record is a frozen dataclass of JSON-able fields with ``to_dict``/``from_dict``, so a
saved run can be replayed by the views without any rank or any torch import. The ranks
write them (as dicts), the driver passes them on, and the widgets read them through
``from_dict``: a key the record does not know, or a required key that is missing, raises
``RecordShapeError`` naming the record and the key, so a change of shape on the ranks
fails loudly instead of drawing nothing. Standard library only: the widgets import this.
Every record lives here, also those of one subsystem (what a rank publishes while it
trains, the parameter server's spans), which is why the module is longer than most.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Record")


class RecordShapeError(ValueError):
    """A dict does not have the shape of the record it should be (unknown or missing keys)."""


class Record:
    """Mixin: conversion to and from plain dicts (tuples become lists in JSON)."""

    _nested: ClassVar[dict[str, type["Record"]]] = {}  # field -> record type of its items (tuple or dict of them)

    def to_dict(self) -> dict[str, Any]:
        """Return the record as a JSON-able dict, equal to itself after a JSON round trip (lists, not tuples)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        """Build the record from a dict made by ``to_dict`` (or read back from JSON); strict about its keys."""
        if not isinstance(data, Mapping):
            raise RecordShapeError(f"{cls.__name__}: expected a dict, got {type(data).__name__} {data!r:.80}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for key in data:
            if key not in fields:
                raise RecordShapeError(f"{cls.__name__}: unknown key {key!r}; its keys are {list(fields)}")
        for name, f in fields.items():
            if name not in data and f.default is f.default_factory is dataclasses.MISSING:
                raise RecordShapeError(f"{cls.__name__}: missing key {name!r}")
        return cls(**{k: cls._field_value(k, v) for k, v in data.items()})

    @classmethod
    def _field_value(cls, name: str, value: Any) -> Any:
        """JSON lists back to tuples; nested record dicts back to records."""
        inner = cls._nested.get(name)
        if inner is not None and isinstance(value, Mapping):
            return {k: inner.coerce(v) for k, v in value.items()}
        if isinstance(value, list):
            return tuple(inner.coerce(v) for v in value) if inner is not None else tuple(value)
        return value

    @classmethod
    def coerce(cls: type[T], item: Any) -> T:
        """``item`` if it is already this record, else ``from_dict(item)`` (records or their dicts both work)."""
        return item if isinstance(item, cls) else cls.from_dict(item)


@dataclass(frozen=True)
class EngineInfo(Record):
    """What one engine reports about itself before it becomes a rank."""

    engine_id: int
    host: str  # the host name the engine reports (socket.gethostname)
    ip: str  # the address other hosts reach this engine on; 127.0.0.1 for a local pool
    pid: int
    gpus: tuple[str, ...] = ()  # physical GPU ids the engine may see (CUDA_VISIBLE_DEVICES entries)
    cpu_count: int = 1


@dataclass(frozen=True)
class RankInfo(Record):
    """One rank of the world: where it lives and what it computes on."""

    rank: int
    local_rank: int
    engine_id: int
    host: str
    ip: str
    pid: int
    device: str  # "cpu" or "cuda:<index>" as the engine itself sees its GPUs
    gpu: str | None  # the physical GPU id behind ``device``, None on CPU
    backend: str  # "nccl" or "gloo"


@dataclass(frozen=True)
class RankMap(Record):
    """The whole world: ranks in order, the backend and where rank 0 listens."""

    ranks: tuple[RankInfo, ...]
    backend: str
    master_addr: str
    note: str = ""  # why this backend was chosen, shown to the user

    _nested: ClassVar[dict[str, type[Record]]] = {"ranks": RankInfo}

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    def by_engine(self) -> dict[int, RankInfo]:
        """Ranks keyed by ipyparallel engine id."""
        return {r.engine_id: r for r in self.ranks}

    def hosts(self) -> dict[str, list[int]]:
        """Host name -> ranks on it, hosts in rank order."""
        out: dict[str, list[int]] = {}
        for r in self.ranks:
            out.setdefault(r.host, []).append(r.rank)
        return out


@dataclass(frozen=True)
class RankStatus(Record):
    """A rank as the pool sees it now, for the rank table and the cluster view."""

    rank: int
    host: str
    pid: int
    device: str
    backend: str
    threads: int
    state: str = "idle"  # idle | busy | failed | dead
    detail: str = ""  # last error, or what the rank is doing
    rss_bytes: int | None = None  # resident memory of the engine process; None where it cannot be read
    last_heard_s: float | None = None  # seconds since the rank's last progress record (lab.run.run_handle); None: none


@dataclass(frozen=True)
class RankFailure(Record):
    """Why one rank's call failed, with the traceback as the rank printed it."""

    rank: int
    host: str
    ename: str  # exception class name, or "EngineDied" (the engine process is gone) / "Timeout" / "Killed"
    evalue: str
    traceback: str
    collateral: bool = False  # failed only because a peer left a collective, or kept waiting for a late one
    where: str = ""  # the user's own frame with its source lines, as the driver shows it


@dataclass(frozen=True)
class CellOutput(Record):
    """What one rank's run of a ``%%px`` cell wrote and displayed, and the value of its last expression."""

    stdout: str = ""
    stderr: str = ""
    displays: tuple[dict[str, Any], ...] = ()  # mime bundles of the cell's display() calls, in order
    value: dict[str, Any] | None = None  # mime bundle of the last expression's value; None when it has none


@dataclass(frozen=True)
class TraceEvent(Record):
    """One timed action on one rank, in seconds since rank 0's epoch (aligned clocks).

    kind: forward | backward | backward_weight (compute, counted as busy) | send | recv |
    a collective name (all_reduce, ...) | optimizer.
    """

    rank: int
    stage: int | None  # global pipeline stage index; None for rank-wide actions (optimizer)
    kind: str
    microbatch: int | None
    start: float
    end: float
    action: str = ""  # compute only: torch's letter F, B (full backward), I (input-grad), W (weight-grad)
    step: int = 0  # index of the traced step
    peer: int | None = None  # p2p: the other global rank
    nbytes: int = 0  # p2p and collectives: bytes this rank sent or received

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start


@dataclass(frozen=True)
class ClockSync(Record):
    """One rank's clock offset to rank 0, bounded by timestamped barrier round trips."""

    rank: int
    offset: float  # local clock minus rank 0's clock, seconds
    uncertainty: float  # half of rtt: the offset is exact to within this
    rtt: float  # width of the interval the barrier round trips leave for the offset
    rounds: int  # sweeps of barriers, each rank arriving last once per sweep
    epoch: float  # rank 0's clock at the end of the sync; events count from here


@dataclass(frozen=True)
class BubbleReport(Record):
    """Measured idle share of one pipeline step (docs/design.md#bubble-ratio) beside the theory."""

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int
    ranks: tuple[int, ...]
    idle: tuple[float, ...]  # per rank, same order as ranks: 1 - busy / makespan
    busy: tuple[float, ...]  # per rank: summed F, B/I, W durations, seconds
    makespan: float  # first compute start to last compute end over all ranks, seconds
    mean: float  # mean of idle over ranks
    theory: float | None  # (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved; None: no closed form here
    theory_megatron: float | None  # bubble-to-ideal: (p-1)/m, or (p-1)/(v*m)
    synthetic: bool = False  # fixed synthetic action costs (comparable with theory)
    step: int = 0
    clock_uncertainty: float = 0.0  # worst rank's alignment uncertainty, seconds


@dataclass(frozen=True)
class MemoryRecord(Record):
    """One memory category of one rank at one moment, measured beside its predictions (docs/design.md#memory-categories).

    moment: "at_rest" (after optimizer.step, before zero_grad) | "peak_fwd_bwd" (forward
    done, backward not started). category: params | grads | optimizer | activations |
    cuda_allocated (the allocator now) | cuda_max_allocated (its peak in the step) |
    activations.<part> (the activations again, by part: kernels/measure/activation_parts.py). Bytes throughout.
    """

    rank: int
    moment: str
    category: str
    measured: int | None  # None: not measurable here (the cuda_* categories on CPU)
    predicted: float | None  # the exact rule: chunk/padding, ZeRO-1 greedy partition, step scalars
    formula: float | None  # The ZeRO formula of docs/design.md#zero-formulas for the dtypes held (fp32: 4Ψ, 4Ψ, K=8)
    note: str = ""  # why predicted differs from formula (padding, partition, step scalars, TP)
    predicted_source: str = ""  # where ``predicted`` comes from, or why there is none (activations: activation_rules)


@dataclass(frozen=True)
class CommRecord(Record):
    """One collective type on one rank over one step, counted as nccl-tests counts it (docs/design.md#bus-bandwidth)."""

    rank: int
    op: str  # all_reduce | all_gather | reduce_scatter | broadcast | all_to_all | send | recv
    group_size: int
    count: int
    payload_bytes: int  # the tensor each call works on (all_gather: whole output), summed
    wire_bytes: float  # payload × busbw factor: what a ring sends from this rank
    seconds: float  # summed time of the calls (each waited for at once)
    algbw: float  # payload_bytes / seconds, bytes/s
    busbw: float  # algbw × busbw factor, bytes/s
    predicted_payload_bytes: float | None = None  # the analytic volume of docs/design.md#communication-volume
    # "dist" (torch.distributed call) | "funcol" (DTensor functional collective) |
    # "pipeline" (a pipeline stage's boundary send, counted without its time)
    source: str = ""
    note: str = ""
    # Of wire_bytes, what went to ranks on this rank's host and to other hosts, counted as a ring
    # counts it (lab/measure/host_traffic.py); None when the destinations were not recorded
    intra_bytes: float | None = None
    inter_bytes: float | None = None
    predicted_inter_bytes: float | None = None  # the planner's inter-host bytes on the same rank -> host placement


@dataclass(frozen=True)
class BenchRecord(Record):
    """One point of a collective bandwidth sweep (nccl-tests style), slowest rank's time."""

    op: str  # all_reduce | all_gather | reduce_scatter | broadcast | send_recv
    size_bytes: int  # payload per call (all_gather: the gathered output; reduce_scatter: the input)
    world: int
    iters: int
    seconds: float  # mean seconds per call on the slowest rank
    algbw: float  # size_bytes / seconds, bytes/s
    busbw: float  # algbw × factor, bytes/s
    factor: float  # nccl-tests: all_reduce 2(n-1)/n, all_gather/reduce_scatter (n-1)/n, else 1
    link: str = ""  # "intra": groups inside each host, "inter": groups of one rank per host; "": the whole world


@dataclass(frozen=True)
class CollectiveRecord(Record):
    """One collective run once on one rank with inputs checkable by hand (``kernels.engine.collectives``)."""

    op: str  # all_reduce | all_gather | reduce_scatter | broadcast | send_recv
    rank: int
    input: tuple[float, ...]  # what this rank contributed, a function of (op, rank, world) alone
    output: tuple[float, ...]  # what the real collective left on this rank


@dataclass(frozen=True)
class ParamLayout(Record):
    """How one parameter lies on one rank: DTensor's view of it (``kernels.parallel.fsdp.describe_params``)."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # the slice this rank holds
    placements: tuple[str, ...]  # str() of each DTensor placement per mesh axis ("S(0)", "_S(0, 2)", "R"); () plain
    mesh_axes: tuple[str, ...]  # the mesh axis names the placements refer to, same order
    dtype: str  # str(torch dtype) of the local tensor, e.g. "torch.float32"
    offset: Any = None  # the slice's start: one int per dim, or an int for dim 0; None: computed from the coords


@dataclass(frozen=True)
class LayoutRecord(Record):
    """The layout one rank really built (``RunResult.layout[rank]``), read by the sharding view.

    strategy: ddp | zero1 | fsdp | tp | ... ; "pp-<schedule>" on pipeline ranks (the dp
    layout inside is ``dp_strategy``); "idle" for a rank beyond the world; "reference" for
    the one-process run.
    """

    rank: int
    strategy: str
    coords: dict[str, int] = field(default_factory=dict)  # mesh axis -> this rank's index (pp, dp, tp)
    zero: int = 0  # ZeRO stage of the data-parallel layout
    hybrid: bool = False  # HSDP: sharded within dp_shard groups, replicated across dp_replicate
    params: dict[str, ParamLayout] = field(default_factory=dict)  # parameter name -> its layout here
    optimizer_params: tuple[str, ...] | None = None  # ZeRO-1: names whose optimizer state this rank owns
    dp_strategy: str = ""  # pipeline ranks: the data-parallel layout of each stage
    schedule: str = ""  # pipeline ranks: the schedule's name
    stage_ids: tuple[int, ...] = ()  # pipeline ranks: global stage indices held, in placement order
    stage_layers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # str(stage) -> its block indices

    _nested: ClassVar[dict[str, type[Record]]] = {"params": ParamLayout}


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
class MemorySample(Record):
    """What one rank held at the end of one action of the traced step (``kernels.measure.memory_timeline``), bytes.

    kind: start | forward | backward | backward_weight (with stage, micro-batch and F/B/I/W action) | all_reduce |
    optimizer. ``t`` is in seconds since rank 0's epoch, as ``TraceEvent`` times.
    """

    rank: int
    t: float
    kind: str
    params: int
    grads: int
    optimizer: int
    activations: int  # storages autograd holds for backward at this instant, parameters left out
    stage: int | None = None
    microbatch: int | None = None
    action: str = ""
    cuda_allocated: int | None = None  # torch.cuda.memory_allocated; None on CPU
    step: int = 0

    @property
    def total(self) -> int:
        """The four categories together."""
        return self.params + self.grads + self.optimizer + self.activations


# What a rank publishes while it trains: its collectives (kernels.watch.collective_log) and each step.


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


# The parameter server's spans of a rank's time (kernels.ps.ps_train, kernels.ps.parameter_server).

SPAN_KINDS = ("pull", "compute", "push", "apply")  # a worker's three, a server's one


@dataclass(frozen=True)
class PSSpan(Record):
    """Rank ``rank`` spent [start, end] (wall clock, seconds) on ``kind`` in its step (update, on a server) ``step``."""

    rank: int
    kind: str  # one of SPAN_KINDS
    step: int
    start: float
    end: float
