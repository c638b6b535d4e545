"""The lab's collective hooks on a training rank: every collective and traced action published as it happens.

``RankWatch`` ties ``kernels.watch.collective_log`` (the state file the driver reads, even
while this rank is blocked in C++) and ``kernels.watch.faults`` (faults and pacing) to a
training run:

- collectives: while ``patched()`` is active the ``torch.distributed`` namespace
  functions are wrapped (as ``kernels.watch.comm.CommMeter`` wraps them): entry is logged with
  the op, the group (named by its mesh axis), its ranks, the group's sequence number and
  the payload; exit is logged when the call returns, or for an async collective when its
  future completes (the backend's thread only queues it; the main thread publishes it). DDP's buckets are all-reduced in C++
  unless a Python comm hook is registered, so ``attach`` routes DDP through torch's stock
  ``allreduce_hook`` (``kernels.watch.comm.route_ddp_through_python``, the same maths). Blocking
  send/recv are logged; isend/irecv (a pipeline's p2p) are not: ``P2POp`` accepts only
  torch's own functions, and gloo's p2p works have no future to log their end. Their
  waits, and DTensor's functional collectives' (which never pass through the namespace),
  still count in the step's wait: ``kernels.watch.wait_clock`` tells the log of every
  blocking wait on this thread;
- actions: forward pre/post hooks on the trained modules, a gradient hook on each
  output (backward starts), the optimizer's step pre-hook; the first forward of a step
  is where step faults strike. The forward and backward windows (the latter closed by an
  autograd callback when the graph is done) are the compute the step's overlap is
  measured against (``kernels.watch.overlap``);
- steps: ``batches(stream)`` wraps the batch stream, so each batch drawn starts a step;
- the driver on another host: on an engine, a ``kernels.watch.flight_recorder.WatchBeacon``
  thread sends the state, and torch's flight-recorder summary, over ipyparallel while
  the run goes.

``finish()`` returns the per-step ``StepWait`` records (time inside collectives, in the
gradient sync, and the rest). The state file is written from the log's publisher thread,
at most every 100 ms, not at each change (docs/design.md#watching-ranks has the measured figures).

It is used by ``kernels.train.entry.train_rank`` (with ``watch_collectives`` or faults), which
sits above this module; tests/test_faults.py runs it on real ranks (stragglers, hangs, crashes).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.contract.faults import Fault
from kernels.watch import faults as fault_kinds
from kernels.watch import flight_recorder
from kernels.watch.collective_log import CollectiveLog
from kernels.contract.watch_records import StepWait
from kernels.watch.comm import route_ddp_through_python
from kernels.watch.dist_names import DIST_OPS, patched_dist_names
from kernels.watch.state_file import PUBLISH_EVERY_S
from kernels.watch.wait_clock import install_listener, remove_listener

# isend/irecv stay unwrapped: P2POp accepts only those very functions (checked by identity), and
# gloo's p2p works have no future to log their end with.
_OPS = {**{k: v for k, v in DIST_OPS.items() if k not in ("isend", "irecv")}, "barrier": ("barrier", lambda a: 0)}


class RankWatch:
    """One run's hooks on this rank (module docstring); ``faults`` are the run's faults, every rank's."""

    def __init__(self, meshes: list[Any], faults: tuple[Fault, ...] = (),
                 synthetic_forward_s: float | None = None) -> None:
        self.rank = dist.get_rank()
        self.log = CollectiveLog(self.rank, publish_every_s=PUBLISH_EVERY_S)
        self.faults = fault_kinds.faults_for(faults, self.rank)
        self.pacing = fault_kinds.pacing_for(self.faults, synthetic_forward_s)
        fault_kinds.note_slow(self.faults, self.log.note_fault)
        self._names = _group_names(meshes)
        self._beacon = flight_recorder.engine_beacon(self.log.path, flight_recorder.mesh_axis_names(meshes))
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._local = threading.local()
        self._handles: list[Any] = []
        self._micro: dict[str, int] = {}  # forwards so far this step, per traced module
        self._forward_began = self._forward_real = 0.0

    # ------------------------------------------------------------ collectives
    @contextlib.contextmanager
    def patched(self) -> Iterator["RankWatch"]:
        """Wrap the ``torch.distributed`` collectives while active."""
        if self._beacon is not None:
            self._beacon.start()
        install_listener(self.log)  # waits outside the wrapped calls (p2p, DTensor's) count in the step's wait
        try:
            with patched_dist_names(list(_OPS), self._wrap):
                yield self
        finally:
            remove_listener(self.log)
            for handle in self._handles:
                handle.remove()
            if self._beacon is not None:
                self._beacon.stop()
            self.log.close()

    def _group(self, group: Any) -> tuple[str, tuple[int, ...]]:
        pg = group if group is not None else dist.group.WORLD
        key = id(pg)
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(pg))
        return self._names.get(key, "world" if pg is dist.group.WORLD else "group"), self._ranks[key]

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        op, payload = _OPS[name]
        names = tuple(inspect.signature(fn).parameters)  # the arguments by name, as Signature.bind gives them

        @functools.wraps(fn)  # keeps the signature for wrappers around this one (kernels.watch.comm's meter binds it)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):  # an inner call of a logged one
                return fn(*args, **kwargs)
            a = {**dict(zip(names, args)), **kwargs}
            group, ranks = self._group(a.get("group"))
            peer = a.get("dst", a.get("src"))  # a global rank in torch's p2p API
            if op in ("send", "recv") and peer is not None:
                ranks = tuple(sorted({self.rank, peer}))
            token = self.log.enter(op, group, ranks, payload(a))
            self._local.depth = 1
            try:
                work = fn(*args, **kwargs)
            except BaseException:
                self.log.leave(token)
                raise
            finally:
                self._local.depth = 0
            if work is None or not hasattr(work, "get_future"):
                self.log.leave(token)
            else:
                work.get_future().add_done_callback(lambda _, token=token: self.log.completed(token))
            return work
        return wrapper

    # --------------------------------------------------------------- actions
    def attach(self, modules: list[nn.Module], optimizer: Any, stage_ids: list[int] | None = None) -> None:
        """Trace (and pace, and strike faults in) ``modules``' forwards and backwards and ``optimizer``'s steps."""
        for i, module in enumerate(modules):
            if isinstance(module, DDP):
                if not module._comm_hooks:  # private list: a second hook would raise
                    route_ddp_through_python(module)
                # DDP's own forward may run C++ collectives (on its second step, the rebuilt buckets'
                # broadcast): faults strike in the user's model, after them, as a real hang would.
                module = module.module
            where = f", stage {stage_ids[i]}" if stage_ids is not None else ""
            self._handles.append(module.register_forward_pre_hook(self._before_forward(where)))
            self._handles.append(module.register_forward_hook(self._after_forward(where)))
        self._handles.append(optimizer.register_step_pre_hook(
            lambda *_: self.log.act(f"optimizer, step {self.log.step}")))

    def _before_forward(self, where: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            step = self.log.step
            self.log.act(f"forward, step {step}, micro-batch {self._micro.get(where, 0)}{where}")
            if not self._micro:
                for fault in self.faults:
                    fault_kinds.strike(fault, step, self.log.note_fault)
            self._forward_began = time.perf_counter()
        return hook

    def _after_forward(self, where: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            micro = self._micro.get(where, 0)
            if self.pacing.active:
                self._forward_real = self.pacing.after_forward(self._forward_began)
            self.log.spans.compute.append((self._forward_began, time.perf_counter()))  # kernels.watch.overlap
            self._micro[where] = micro + 1
            tensor = fault_kinds.output_tensor(out)
            if tensor is not None:
                tensor.register_hook(self._before_backward(f"backward, step {self.log.step}, micro-batch {micro}{where}",
                                                           self._forward_real))
        return hook

    def _before_backward(self, action: str, forward_real_s: float) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.log.act(action)
            began = time.perf_counter()
            # The backward window ends when the graph is done: a callback queued now runs before the ones
            # queued later, DDP's finalizer (which waits for every bucket) among them.
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.log.spans.compute.append((began, time.perf_counter())))
            if self.pacing.active:
                self.pacing.before_backward(forward_real_s)
        return hook

    # ----------------------------------------------------------------- steps
    def batches(self, stream: Any, first: int = 0) -> "WatchedBatches":
        """``stream`` with a step boundary logged at each batch drawn, the first one step ``first``
        (a held training's call goes on from where the last stopped, and its step faults name global steps)."""
        return WatchedBatches(stream, self, first)

    def begin_step(self, step: int) -> None:
        self._micro = {}
        self.log.begin_step(step)

    def finish(self) -> list[StepWait]:
        """Every step's ``StepWait``; the state file says "done"."""
        return self.log.finish()


class WatchedBatches:
    """A batch stream whose every batch starts a logged step (the training loop needs only iteration and ``device``)."""

    def __init__(self, stream: Any, watch: RankWatch, first: int = 0) -> None:
        self.stream, self.watch, self.device, self.first = stream, watch, stream.device, first

    def __iter__(self) -> Iterator[Any]:
        for step, batch in enumerate(self.stream, start=self.first):
            self.watch.begin_step(step)
            yield batch


def _group_names(meshes: list[Any]) -> dict[int, str]:
    """id(process group) -> its mesh axis name, for every axis of ``meshes`` (None entries skipped)."""
    names = {}
    for mesh in meshes:
        if mesh is None or mesh.mesh_dim_names is None:
            continue
        for axis in mesh.mesh_dim_names:
            names.setdefault(id(mesh.get_group(axis)), axis)
    return names

