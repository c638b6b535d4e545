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


@dataclass(frozen=True)
class RankFailure(Record):
    """Why one rank's call failed, with the traceback as the rank printed it."""

    rank: int
    host: str
    ename: str  # exception class name, or "Dead" / "Timeout"
    evalue: str
    traceback: str
    collateral: bool = False  # failed only because a peer left a collective
