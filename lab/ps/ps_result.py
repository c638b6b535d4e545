"""What a parameter-server run measured: a ``RunResult`` plus the PS records, as plain data.

``ps`` holds the run's roles and records as the ranks sent them (``kernels.ps.ps_train``):
``servers`` (each server's parameters, bytes in and out, updates, the staleness of every
gradient it applied, its apply spans), ``workers`` (pulls, pushes, bytes, seconds waiting
and computing, staleness, pull/compute/push spans, losses), ``shards`` and the mode. The
methods below are pure functions of those fields, so a result read back from JSON answers
the same.

Bytes are payload bytes: the tensors' ``numel * element_size`` that each push and pull
carries, counted where they are sent and received (TensorPipe's own framing is not in them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lab.run.run_result import RunResult


def allreduce_bytes_per_rank(size_bytes: int, n: int) -> float:
    """What a ring all-reduce of ``size_bytes`` sends per rank among n ranks: 2(n-1)/n * size."""
    return 2 * (n - 1) / n * size_bytes


def server_bytes_per_step(shard_bytes: int, workers: int) -> int:
    """What one server moves per synchronous step: every worker pushes the shard's gradients and pulls it back."""
    return 2 * workers * shard_bytes


@dataclass(frozen=True)
class PSResult(RunResult):
    """A ``RunResult`` whose ``losses`` are the workers' mean loss per step, with the PS records in ``ps``."""

    ps: dict[str, Any] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        """"sync", "async" or "bounded"."""
        return self.ps["mode"]

    @property
    def staleness(self) -> list[int]:
        """The staleness of every gradient the servers applied (server version minus the version read)."""
        return [s for server in self.ps["servers"] for s in server["staleness"]]

    def staleness_histogram(self) -> dict[int, int]:
        """Staleness -> how many applied gradients had it."""
        out: dict[int, int] = {}
        for s in self.staleness:
            out[s] = out.get(s, 0) + 1
        return dict(sorted(out.items()))

    @property
    def model_bytes(self) -> int:
        """Bytes of the whole model's parameters (the size an all-reduce moves)."""
        return sum(server["param_bytes"] for server in self.ps["servers"])

    def server_bytes(self) -> list[dict[str, Any]]:
        """Per server: bytes moved per step (in + out, measured) beside ``server_bytes_per_step``'s formula."""
        workers, steps = len(self.ps["workers"]), len(self.losses)
        return [{"rank": s["rank"], "param_bytes": s["param_bytes"],
                 "measured_per_step": (s["bytes_in"] + s["bytes_out"]) / steps,
                 "formula_per_step": server_bytes_per_step(s["param_bytes"], workers)} for s in self.ps["servers"]]

    def busiest_server_bytes(self) -> float:
        """Measured bytes per step through the busiest server."""
        return max(row["measured_per_step"] for row in self.server_bytes())

    def bandwidth_table(self) -> str:
        """The busiest server's bytes per step against what all-reduce sends per rank among the same workers."""
        n, size = len(self.ps["workers"]), self.model_bytes
        ring = allreduce_bytes_per_rank(size, n)
        busiest = self.busiest_server_bytes()
        return "\n".join([f"model: {size} bytes; {len(self.ps['servers'])} server(s), {n} workers",
                          f"busiest server, per step (measured): {busiest:,.0f} bytes",
                          f"all-reduce per rank, 2(n-1)/n*size (n={n}): {ring:,.0f} bytes",
                          f"server / all-reduce rank: {busiest / ring:.2f}x"])

    def worker_table(self) -> list[dict[str, Any]]:
        """Per worker: pulls, pushes, bytes sent and received, seconds waiting and computing."""
        keys = ("rank", "pulls", "pushes", "bytes_sent", "bytes_received", "wait_s", "compute_s")
        return [{k: w[k] for k in keys} for w in self.ps["workers"]]

    def ps_events(self) -> list[dict[str, Any]]:
        """Every pull/compute/push span of the workers and apply span of the servers (wall clock, seconds)."""
        return [e for role in ("servers", "workers") for r in self.ps[role] for e in r["events"]]

    def loss_by_time(self) -> list[tuple[float, float]]:
        """(seconds since the first pull, mean loss) at the end of each step."""
        start = min(e["start"] for w in self.ps["workers"] for e in w["events"])
        ends = [max(e["end"] for w in self.ps["workers"] for e in w["events"] if e["step"] == step)
                for step in range(len(self.losses))]
        return [(end - start, loss) for end, loss in zip(ends, self.losses)]
