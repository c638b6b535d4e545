"""The parameter server's shard: it holds some parameters, applies the workers' pushes, serves pulls.

Algorithm: the parameter server of Li et al. (OSDI 2014, "Scaling Distributed Machine
Learning with the Parameter Server"): workers pull the parameters, compute gradients on
their share of the data and push them; each server owns a shard of the parameters and
runs the run's optimizer (AdamW or SGD, ``kernels.train.optimizer`` on the shard's tensors) on it. Three
consistency models decide when a push is applied:

- ``sync``: a step's update waits for every worker's push; the server applies their mean
  once (the same maths as data parallel's all-reduce mean, so losses match DDP);
- ``async`` (Hogwild-style, Recht et al. 2011; Dean et al. 2012's Downpour SGD): each push
  is applied on arrival, on whatever version the parameters have reached meanwhile;
- ``bounded`` (stale synchronous parallel, Ho et al. 2013) with ``max_staleness = s``: a
  push is held while applying it would leave another worker's outstanding read more than
  s versions behind; when every worker with an outstanding read is held, their pushes are
  applied together as one mean update, so nobody waits forever.

Staleness of an applied gradient = the shard's version when it is applied minus the
version the worker read. ``push`` returns a ``torch.futures.Future``; the RPC function that
calls it (``kernels.ps.ps_train.push_shard``) is an ``async_execution`` one, so a held push
costs no RPC thread, only a pending future.

Run alone: see ``kernels.ps.ps_train`` (this module is the server half).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
from torch.futures import Future

from kernels.train.optimizer import build_optimizer
from kernels.contract.ps_records import PSSpan
from kernels.contract.run_config import RunConfig

MODES = ("sync", "async", "bounded")


def split_by_bytes(sizes: dict[str, int], servers: int) -> list[list[str]]:
    """Parameter names per server, balanced by bytes: largest first onto the least loaded (ties: lowest server)."""
    shards: list[list[str]] = [[] for _ in range(servers)]
    load = [0] * servers
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(servers), key=lambda s: (load[s], s))
        shards[target].append(name)
        load[target] += sizes[name]
    return shards


class ShardServer:
    """One server's parameters (name -> fp32 tensor), their optimizer, version and bookkeeping."""

    def __init__(self, rank: int, params: dict[str, torch.Tensor], run: RunConfig,
                 mode: str, workers: list[int], max_staleness: int | None) -> None:
        self.rank, self.mode, self.workers, self.max_staleness = rank, mode, workers, max_staleness
        self.params = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
        self.optimizer = build_optimizer(list(self.params.values()), run)  # the reference's optimizer and settings
        self.version = 0
        self.lock = threading.Lock()
        self.reads: dict[int, int] = {}  # worker -> version it pulled and has not pushed back yet
        self.held: dict[int, tuple[int, dict[str, torch.Tensor], Future]] = {}  # worker -> (read, grads, reply)
        self.failure: BaseException | None = None
        self.finished: set[int] = set()  # workers that have pushed their last step
        self.stop_after: int | None = None  # once a stop is asked: the last step a worker may start
        self.done = threading.Event()  # every worker finished, or the run failed
        self.staleness: list[int] = []  # of every applied gradient, in order
        self.updates = self.pushes = self.pulls = self.bytes_in = self.bytes_out = 0
        self.events: list[dict[str, Any]] = []  # apply spans on this rank's wall clock

    @property
    def nbytes(self) -> int:
        """Bytes of this shard's parameters."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def pull(self, worker: int, step: int) -> tuple[int, dict[str, torch.Tensor], bool]:
        """The current version, a copy of the shard's parameters, and whether ``worker`` must stop before ``step``."""
        with self.lock:
            self._check_alive()
            self.reads[worker] = self.version
            self.pulls += 1
            self.bytes_out += self.nbytes
            stop = self.stop_after is not None and step > self.stop_after
            return self.version, {n: p.detach().clone() for n, p in self.params.items()}, stop

    def ask_stop(self) -> None:
        """Let no worker start a new step: in sync mode after the step under way (all workers run it), else at once.

        In sync mode the version is the index of the step every worker is in (none can
        pull for the next before all pushed this one), so every worker stops after the
        same step and no push is left waiting for a worker that stopped.
        """
        with self.lock:
            if self.stop_after is None:
                self.stop_after = self.version if self.mode == "sync" else -1

    def push(self, worker: int, read: int, grads: dict[str, torch.Tensor]) -> Future:
        """Take ``worker``'s gradients (computed on version ``read``); the future completes with the version after."""
        reply: Future = Future()
        with self.lock:
            if self.failure is not None:
                reply.set_exception(self.failure)
                return reply
            self.pushes += 1
            self.bytes_in += sum(g.numel() * g.element_size() for g in grads.values())
            self.held[worker] = (read, grads, reply)
            answered = self._apply_ready()
        for done, version in answered:  # outside the lock: completing a future runs the RPC reply's callbacks
            done.set_result(version)
        return reply

    def finish(self, worker: int) -> None:
        """``worker`` has no more steps; once every worker has said so, ``done`` is set.

        Its read is dropped (a worker that stopped pulled without pushing back), which may
        release pushes that a bounded server held for it.
        """
        with self.lock:
            self.finished.add(worker)
            self.reads.pop(worker, None)
            answered = self._apply_ready() if self.failure is None else []
            if self.finished >= set(self.workers):
                self.done.set()
        for done, version in answered:
            done.set_result(version)

    def fail(self, error: BaseException) -> None:
        """Answer every held push (and any later call) with ``error``: this server stops."""
        with self.lock:
            self.failure = self.failure or error
            held, self.held = self.held, {}
        for _, _, reply in held.values():
            reply.set_exception(self.failure)
        self.done.set()

    def wait_done(self, stop_asked: Callable[[], bool] = lambda: False, poll_s: float = 0.05) -> None:
        """Block until every worker finished (or raise the failure); short waits, so an interrupt lands.

        ``stop_asked`` is polled between waits: once it says so, ``ask_stop``.
        """
        while not self.done.wait(poll_s):
            if stop_asked():
                self.ask_stop()
        self._check_alive()

    def record(self) -> dict[str, Any]:
        """This server's load: what it holds, what it received and sent, the staleness it applied."""
        return {"rank": self.rank, "params": sorted(self.params), "param_bytes": self.nbytes,
                "updates": self.updates, "pushes": self.pushes, "pulls": self.pulls, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "staleness": list(self.staleness), "events": list(self.events)}

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _apply_ready(self) -> list[tuple[Future, int]]:
        # Called with the lock held: apply what the mode allows now, repeatedly; returns the replies to send.
        if self.mode == "sync":
            return self._apply(sorted(self.held)) if len(self.held) == len(self.workers) else []
        answered: list[tuple[Future, int]] = []
        while self.held:
            ready = [w for w in sorted(self.held, key=lambda w: (self.held[w][0], w)) if self._may_apply_alone(w)]
            if ready:
                answered += self._apply([ready[0]])
            elif all(w in self.held for w in self.reads):  # everyone still reading is held: apply them together
                answered += self._apply(sorted(self.held))
            else:
                break
        return answered

    def _may_apply_alone(self, worker: int) -> bool:
        if self.mode == "async":
            return True
        others = [read for w, read in self.reads.items() if w != worker]
        return all(self.version + 1 - read <= self.max_staleness for read in others)

    def _apply(self, workers: list[int]) -> list[tuple[Future, int]]:
        """One optimizer step on the mean of these workers' gradients (summed in worker order); their replies."""
        began = time.time()
        for name, p in self.params.items():
            # A worker whose share never reached a parameter (an unrouted expert) pushes none for it: the mean
            # counts it as zero, as DDP does, and a parameter no worker reached keeps no gradient, so AdamW
            # leaves it as one process would.
            pushed = [self.held[w][1][name] for w in workers if name in self.held[w][1]]
            p.grad = sum(pushed) / len(workers) if pushed else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        replies = []
        for w in workers:
            read, _, reply = self.held.pop(w)
            self.staleness.append(self.version - read)
            self.reads.pop(w, None)
            replies.append(reply)
        self.version += 1
        self.updates += 1
        self.events.append(PSSpan(self.rank, "apply", self.updates - 1, began, time.time()).to_dict())
        return [(reply, self.version) for reply in replies]
