"""A parameter server on the pool: ranks 0..servers-1 hold parameter shards, the others are workers.

``ParameterServer(cluster, model, servers=1, mode="sync", ...)`` checks every argument
before anything runs (one ``ParallelConfigError`` naming each broken rule). ``run()``
opens a rendezvous store for ``torch.distributed.rpc`` on rank 0 (``kernels.ps.ps_rpc``),
then runs ``kernels.ps.ps_train.ps_rank`` on every rank and gathers a ``PSResult``. The
agent is stopped at the end of the call, and at once on any failure, so the pool stays
usable for an ``Experiment`` or another run. A worker that raises gives a ``RankError``
naming it; the others stop with it (``kernels.ps.ps_train``'s docstring says how).

The run trains the same model, on the same data and with the same optimizer maths as
``lab.Experiment(cluster, model, lab.Parallel(dp=...), same arguments)``: in ``sync`` mode
its losses equal the one-process ``reference()`` and DDP's. ``async`` and ``bounded``
(``max_staleness=s``) trade that equality for not waiting (``kernels.ps.parameter_server``).
``faults=[lab.Slow(rank, factor)]`` makes a worker a straggler; Crash/Hang/Kill act as in
an Experiment, on workers. ``hang_after=s`` raises ``lab.HangError`` once no rank has moved
for s seconds, with a ``HangReport`` that names the workers waiting in their push and the
one that never pushed (``kernels.ps.ps_watch``); a timeout or an interrupt carries the same
report. ``start()`` runs it in the background (``lab.ps.ps_handle``): ``stop()`` ends it after
the step under way, and the result holds the steps that ran.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kernels.contract.config_rules import ConfigError, Problem, is_int, optimizer_problems
from kernels.model.family import model_fields
from kernels.ps.parameter_server import MODES
from kernels.ps.ps_rpc import open_rpc_store
from kernels.ps.ps_train import ps_rank
from kernels.train.reference import train_reference
from kernels.contract.run_config import RunConfig
from kernels.contract.strategy import resolve_strategy
from lab.pool.cluster import Cluster
from lab.pool.cluster_world import listen_addresses
from lab.run.faults import fault_problems, fault_records, hang_after_problems
from lab.pool.hang_report import HangWatch
from lab.run.experiment import run_model
from lab.run.parallel import ParallelConfigError
from lab.ps.ps_handle import PSHandle
from lab.ps.ps_result import PSResult


class ParameterServer:
    """Train ``model`` with parameter servers on ``cluster``; see ``run()`` and ``reference()``."""

    def __init__(self, cluster: Cluster, model: Any, *, servers: int = 1, mode: str = "sync",
                 max_staleness: int | None = None, global_batch: int = 12, steps: int = 3, lr: float = 1e-2,
                 optimizer: str = "adamw", seed: int = 0, faults: Sequence[Any] = (),
                 hang_after: float | None = None) -> None:
        self.model, model_problems = run_model(model)  # any model an Experiment takes
        self.cluster, self.servers, self.mode = cluster, servers, mode
        self.max_staleness, self.global_batch, self.steps, self.lr = max_staleness, global_batch, steps, lr
        self.optimizer, self.seed, self.faults, self.hang_after = optimizer, seed, faults, hang_after
        problems = model_problems or self._problems()
        if problems:  # raised here, before anything reaches the ranks
            raise ParallelConfigError(problems)

    @property
    def workers(self) -> int:
        """How many ranks compute gradients: the world minus the servers."""
        return self.cluster.world_size - self.servers

    def _problems(self) -> list[Problem]:
        world = self.cluster.world_size
        out: list[Problem] = []
        if not (is_int(self.servers) and 1 <= self.servers < world):
            out.append(("ps-servers", f"servers must be an int from 1 to world_size-1 = {world - 1} "
                        f"(at least one rank must be a worker), got {self.servers!r}"))
        if self.mode not in MODES:
            out.append(("ps-mode", f"mode must be one of {MODES}, got {self.mode!r}"))
        if self.mode == "bounded" and not (is_int(self.max_staleness) and self.max_staleness >= 0):
            out.append(("ps-max-staleness", f"mode='bounded' needs max_staleness, an int >= 0, "
                        f"got {self.max_staleness!r}"))
        if self.mode != "bounded" and self.max_staleness is not None:
            out.append(("ps-max-staleness", f"max_staleness is only for mode='bounded' (mode is {self.mode!r})"))
        out += optimizer_problems(self.optimizer) + hang_after_problems(self.hang_after)
        if out:
            return out
        if self.model.seed not in (0, self.seed):
            out.append(("model-seed", f"the model's seed={self.model.seed} is not used: pass seed={self.model.seed} "
                        f"to the ParameterServer, which fixes the weights and the data"))
        if is_int(self.global_batch) and self.global_batch % self.workers:
            out.append(("global-batch", f"global_batch={self.global_batch} must be divisible by the "
                        f"{self.workers} workers"))
        try:
            self.run_config()
        except ConfigError as error:
            out += error.problems
        out += fault_problems(self.faults, world, self.steps)
        out += [("ps-faults", f"{f!r} acts on rank {f.rank}, a server; faults act on workers (ranks "
                 f"{self.servers}..{world - 1})") for f in self._fault_list() if f.rank < self.servers]
        return out

    def _fault_list(self) -> list[Any]:
        return [f for f in self.faults if hasattr(f, "rank")] if isinstance(self.faults, (list, tuple)) else []

    def run_config(self) -> RunConfig:
        """The model, data and optimizer hyper-parameters, as data parallel over the workers would train them."""
        return RunConfig(model=model_fields(self.model), seed=self.seed, global_batch=self.global_batch,
                         steps=self.steps, lr=self.lr, optimizer=self.optimizer,
                         strategy=resolve_strategy(dp=self.workers))

    def rank_config(self, port: int) -> dict[str, Any]:
        """The plain dict every rank receives: the run, the roles, the mode, the faults and the RPC rendezvous."""
        bind = listen_addresses(self.cluster.rank_map)
        return {"run": self.run_config().to_dict(), "servers": self.servers, "mode": self.mode,
                "max_staleness": self.max_staleness, "faults": [f.to_dict() for f in fault_records(self.faults)],
                "rpc": {"master_addr": bind[0], "port": port, "bind_addrs": bind,
                        "timeout_s": self.cluster.collective_timeout}}

    def run(self, *, timeout: float | None = None) -> PSResult:
        """Train on every rank; raises ``lab.RankError`` naming the rank that failed, ``lab.HangError`` after
        ``hang_after`` seconds without progress."""
        bind = listen_addresses(self.cluster.rank_map)
        port = self.cluster.run(open_rpc_store, bind[0], self.cluster.world_size, self.cluster.timeout,
                                ranks=[0])[0]
        began = time.time()
        per_rank = self.cluster.run(ps_rank, self.rank_config(port), timeout=timeout,
                                    hang_watch=HangWatch(self.cluster, self.hang_after))
        return self._result(per_rank, time.time() - began)

    def start(self, *, timeout: float | None = None) -> PSHandle:
        """Start the run and return at once: the handle's ``wait()`` gives the ``PSResult``, ``stop()`` ends it early."""
        return PSHandle(self, timeout=timeout)

    def _result(self, per_rank: list[dict[str, Any]], wall_s: float) -> PSResult:
        servers = [r for r in per_rank if r["role"] == "server"]
        workers = [r for r in per_rank if r["role"] == "worker"]
        ran = min(len(w["losses"]) for w in workers)  # fewer than ``steps`` after a stop
        losses = [sum(w["losses"][step] for w in workers) / len(workers) for step in range(ran)]
        step_times = [[e["end"] - e["start"] for e in _spans(r)] for r in per_rank]
        layout = [{"rank": r["rank"], "strategy": f"ps-{self.mode}", "role": r["role"]} for r in per_rank]
        notes = [n for w in workers for n in w["notes"]]
        ps = {"mode": self.mode, "max_staleness": self.max_staleness, "optimizer": self.optimizer,
              "shards": per_rank[0]["shards"], "servers": servers, "workers": workers, "wall_s": wall_s}
        return PSResult(config=self.rank_config(0)["run"], losses=losses, step_times=step_times, layout=layout,
                        warnings=notes, faults=[f.to_dict() for f in fault_records(self.faults)], ps=ps)

    def reference(self) -> PSResult:
        """The same training in one process, with the same optimizer: what ``sync`` mode must reproduce."""
        out = train_reference(self.run_config())
        return PSResult(config=self.run_config().to_dict(), losses=list(out["losses"]),
                        step_times=[[]], layout=[{"rank": 0, "strategy": "reference"}],
                        grad_norms=list(out["grad_norms"]))


def _spans(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A worker's whole steps (first pull to last push) or a server's apply spans."""
    if record["role"] == "server":
        return record["events"]
    steps = sorted({e["step"] for e in record["events"]})
    return [{"start": min(e["start"] for e in record["events"] if e["step"] == s),
             "end": max(e["end"] for e in record["events"] if e["step"] == s)} for s in steps]
