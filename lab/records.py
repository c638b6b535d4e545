"""Plain records that cross the lines between ranks, driver and views.

Every record is a frozen dataclass of JSON-able fields with ``to_dict``/``from_dict``,
so a saved run can be replayed by the views without any rank or any torch import.
This is the one module that defines them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T", bound="Record")


class Record:
    """Mixin: conversion to and from plain dicts (tuples become lists in JSON)."""

    def to_dict(self) -> dict[str, Any]:
        """Return the record as a JSON-able dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Build the record from a dict made by ``to_dict`` (or read back from JSON)."""
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in data:
                value = data[f.name]
                kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankMap":
        """Build the map, and its ranks, from a dict made by ``to_dict``."""
        ranks = tuple(RankInfo.from_dict(r) for r in data["ranks"])
        return cls(ranks=ranks, backend=data["backend"], master_addr=data["master_addr"],
                   note=data.get("note", ""))


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


@dataclass(frozen=True)
class RankFailure(Record):
    """Why one rank's call failed, with the traceback as the rank printed it."""

    rank: int
    host: str
    ename: str  # exception class name, or "Dead" / "Timeout"
    evalue: str
    traceback: str
    collateral: bool = False  # failed only because a peer left a collective


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
    """Measured idle share of one pipeline step (DESIGN §3) beside the theory."""

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
    """One memory category of one rank at one moment, measured beside its predictions (DESIGN §3).

    moment: "at_rest" (after optimizer.step, before zero_grad) | "peak_fwd_bwd" (forward
    done, backward not started). category: params | grads | optimizer | activations |
    cuda_max_allocated. Bytes throughout.
    """

    rank: int
    moment: str
    category: str
    measured: int | None  # None: not measurable here (cuda_max_allocated on CPU)
    predicted: float | None  # the exact rule: chunk/padding, ZeRO-1 greedy partition, step scalars
    formula: float | None  # DESIGN §3's ZeRO reference for the dtypes held (fp32: 4Ψ, 4Ψ, K=8)
    note: str = ""  # why predicted differs from formula (padding, partition, step scalars, TP)


@dataclass(frozen=True)
class CommRecord(Record):
    """One collective type on one rank over one step, counted as nccl-tests counts it (DESIGN §3)."""

    rank: int
    op: str  # all_reduce | all_gather | reduce_scatter | broadcast | all_to_all | send | recv
    group_size: int
    count: int
    payload_bytes: int  # the tensor each call works on (all_gather: whole output), summed
    wire_bytes: float  # payload × busbw factor: what a ring sends from this rank
    seconds: float  # summed time of the calls (each waited for at once)
    algbw: float  # payload_bytes / seconds, bytes/s
    busbw: float  # algbw × busbw factor, bytes/s
    predicted_payload_bytes: float | None = None  # the analytic volume of DESIGN §3
    source: str = ""  # "dist" (torch.distributed call) | "funcol" (DTensor functional collective)
    note: str = ""


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
