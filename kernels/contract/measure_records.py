"""What the ranks measure: pipeline traces, clocks and the bubble, memory and communication, collective
benchmarks, the layout each rank built, its memory through a traced step, and a run's throughput.

Shapes and rules of every record: ``kernels.contract.records``. Standard library only: the widgets import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kernels.contract.records import Record


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
    # The idle share taken apart (lab/measure/bubble_parts.py): schedule | transfer | other. ``parts`` are
    # the means over ranks and sum to ``mean``; ``rank_parts`` hold each rank's, in ``ranks`` order.
    parts: dict[str, float] = field(default_factory=dict)
    planned: float | None = None  # the planned order's idle share at T_F = T_B = T_W, zero-latency transfer
    theory_form: str = ""  # the closed form ``theory`` comes from, in words (layout_rules.bubble_theory_form)
    rank_parts: dict[str, list[float]] = field(default_factory=dict)  # lists: a JSON round trip keeps them equal


BUBBLE_PARTS = ("schedule", "transfer", "other")  # BubbleReport.parts, in the order they are shown


@dataclass(frozen=True)
class MemoryRecord(Record):
    """One memory category of one rank at one moment, measured beside its predictions (docs/design.md#memory-categories).

    moment: "at_rest" (after optimizer.step, before zero_grad) | "peak_fwd_bwd" (forward
    done, backward not started). category: params | grads | optimizer | activations |
    cuda_allocated (the allocator now) | cuda_max_allocated (its peak in the step) |
    cuda_workspaces (cuBLAS's workspaces, part of cuda_allocated) |
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
    alpha_s: float | None = None  # the α–β fit of this op and link over the sweep's sizes: seconds per ring step
    fit_busbw: float | None = None  # the same fit's bandwidth, bytes/s (None: a single size, nothing to fit)


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
    # ZeRO-1 with TP or PP (by slices): per name, the [start, end) of the flattened local shard whose state it holds.
    optimizer_slices: dict[str, list[int]] | None = None
    dp_strategy: str = ""  # pipeline ranks: the data-parallel layout of each stage
    schedule: str = ""  # pipeline ranks: the schedule's name
    stage_ids: tuple[int, ...] = ()  # pipeline ranks: global stage indices held, in placement order
    stage_layers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # str(stage) -> its block indices
    describe: str = ""  # the layout in words: what was chosen and what it runs as (Strategy.describe)

    _nested: ClassVar[dict[str, type[Record]]] = {"params": ParamLayout}


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


@dataclass(frozen=True)
class Throughput(Record):
    """A run's speed: tokens per second, model FLOPs and MFU, and how much communication compute hid.

    Made by ``lab.measure.throughput`` (docs/design.md#overlap-model-flops-and-mfu). ``step_s`` is the
    median step of the slowest rank, the first step left out when there are more; ``mfu`` (model FLOPs)
    and ``hfu`` (with recomputation) are None without a peak. ``comm_s``, ``busy_s`` and ``overlap_s``
    are per-step means over ranks (``StepWait``): collectives in flight, compute, and the two at once.
    """

    tokens_per_step: int
    step_s: float
    tokens_per_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    flops_per_s: float  # model FLOPs per second, every device together
    devices: int
    peak_flops: float | None  # one device's
    mfu: float | None
    hfu: float | None
    formula: str
    comm_s: float | None = None
    busy_s: float | None = None
    overlap_s: float | None = None
