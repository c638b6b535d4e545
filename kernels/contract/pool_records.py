"""The pool's records: engines, ranks and the rank map, a rank's status and failure, a ``%%px`` cell's output.

Shapes and rules of every record: ``kernels.contract.records``. Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kernels.contract.records import Record


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
