"""Asynchronous checkpoint saves (``checkpoint_async=True``): copied to CPU memory beside the next step, written later.

Algorithm: what ``dcp.async_save`` does, on threads that live as long as the saver: the state
is copied to CPU memory (into the buffers of the run's first save, on the stager's thread:
``kernels.checkpoint.staging_buffers``), and the saver's writer thread hands the copy to
``dcp.save`` over a separate gloo group; rank 0 renames the checkpoint when its write (which
ends after everyone's) is done. ``dcp.async_save`` starts a new thread for every save, and
``Thread.start`` waits until the new thread runs: on ranks that outnumber the cores that wait
was 18-37 ms in a fifth of the saves, longer than the rest of the save call. DCP's plan cache
is on: the saves of one run after the first skip gathering and checking the plans again, and
hand DCP the first save's tensors (the live ones, ``kernels.checkpoint.live_payload``) rather
than a new state dict, and the copy to CPU memory skips what the last save's plan gave other
ranks to write. What is written, and how a save is named once whole, are
``kernels.checkpoint.save_load``'s.
"""
from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from kernels.checkpoint.files import PARTIAL_SUFFIX
from kernels.checkpoint.live_payload import LivePayload
from kernels.checkpoint.save_load import finalize_save
from kernels.checkpoint.staging_buffers import ReusedStagingBuffers


class _CachedPlans(DefaultSavePlanner):
    """DCP's default planner with its plan cache on, under a key of its own, that writes no tensor the stager skipped.

    DCP caches the save plans (and skips gathering the unchanged ones) under the planner's
    key, by default its class name, process-wide: one key per saver keeps a later run of
    another layout on the same warm engine from merging with this one's plans. The key is
    never reused in the process (an ``id()`` can be, once its object is gone, and a stale hit on
    one rank only breaks the plan merge), and ``forget`` drops the saver's entries when it closes.
    """

    _keys = itertools.count()

    def __init__(self, stager: ReusedStagingBuffers) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = f"lab-async-save-{next(self._keys)}"
        self._stager = stager

    def forget(self) -> None:
        """Drop this planner's plans from DCP's process-wide caches (a warm engine runs many savers)."""
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                      SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
            cache.pop(self._cached_plans_key, None)

    def written(self) -> frozenset[str] | None:
        """The flattened keys of the tensors this rank's last finished plan wrote (None before the first)."""
        plan = getattr(self, "plan", None)
        return None if plan is None else frozenset(item.index.fqn for item in plan.items
                                                   if item.type != WriteItemType.BYTE_IO)

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.index.fqn in self._stager.skipped:  # only if every rank's shares changed since the last save
            raise RuntimeError(f"checkpoint: this rank's plan now writes {write_item.index.fqn!r}, which its copy to "
                               "CPU memory skipped as another rank's share; the save is abandoned, not written stale")
        return super().resolve_data(write_item)


class AsyncSaver:
    """``checkpoint_async=True``: each save is copied to CPU memory beside the next step and written in the background.

    ``staged()`` must run before the training next changes the parameters or the optimizer
    state (``RunCheckpoints.before_update``). One save is in flight at a time (the next waits
    for it, so it may copy into the same staging buffers); ``wait()`` finishes the last.
    The background writes use their own gloo group, so they never interleave with the
    training's collectives on the default group.
    """

    def __init__(self, ranks: list[int] | None = None) -> None:
        # Collective: every rank of the world builds it together, also those not in ``ranks`` (None: all of them).
        self.group = dist.new_group(ranks, backend="gloo")
        # Every save of one run has the same keys and shards: after the first, DCP reuses its plans,
        # and the stager copies into the CPU buffers of the first save (DCP's DefaultStager deep-copies each).
        self.stager = ReusedStagingBuffers()
        self.planner = _CachedPlans(self.stager)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lab-checkpoint-writer")
        self.payload = LivePayload()
        self.pending: Future | None = None
        self.staging: Future | None = None  # the copy to CPU memory under way, before the write

    def save(self, path: str, model: nn.Module, optimizer, meta: dict[str, Any]) -> None:
        """Like ``save_checkpoint``, returning once the copy to CPU memory has started; rank 0 renames when the write
        is done."""
        self._finish_local()  # the previous write (one at a time); no barrier: the next save names another directory
        self.stager.only(self.planner.written())  # the plan is cached: this save's share is the last one's
        final, began = Path(path), time.perf_counter()
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        try:
            self.staging = self.stager.stage(self.payload(model, optimizer, dist.get_rank()))
            future = self.writer.submit(self._write, self.staging, str(partial))
        finally:  # the writer waits for the copy: start it whatever happened
            self.stager.start()
        meta = {**meta, "staging_seconds": time.perf_counter() - began}  # what the save call held the training
        if dist.get_rank() == 0:  # done once named: a future of its own, set after the renaming
            named: Future = Future()
            future.add_done_callback(lambda f: self._finalize(f, named, partial, final, meta, began))
            future = named
        self.pending = future

    def staged(self) -> float:
        """Wait for the copy to CPU memory under way, if any (raising its error); the seconds waited.

        Call it before the training changes the parameters or the optimizer state.
        """
        staging, self.staging = self.staging, None
        if staging is None:
            return 0.0
        began = time.perf_counter()
        staging.result()
        return time.perf_counter() - began

    def _write(self, staging: Future, partial: str) -> None:
        """On the writer thread: once the copy to CPU memory is done, write it (collective over the saver's group)."""
        dcp.save(staging.result(), checkpoint_id=partial, process_group=self.group, planner=self.planner)

    @staticmethod
    def _finalize(written: Future, named: Future, partial: Path, final: Path, meta: dict[str, Any],
                  began: float) -> None:
        """Rank 0, in the writer's thread: name the checkpoint as soon as it is whole; ``named`` carries any error."""
        try:
            written.result()
            finalize_save(partial, final, meta, began)
            named.set_result(None)
        except BaseException as error:  # handed on whole to whoever waits on ``named``
            named.set_exception(error)

    def _finish_local(self, barrier: bool = False) -> None:
        """Wait for this rank's save in flight (raising its error); with ``barrier``, for every rank's too."""
        self.staged()
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.result()
            finally:  # every rank meets here, a failed one too, before its error goes up
                if barrier:
                    dist.barrier(group=self.group)

    def wait(self) -> None:
        """Wait for the save in flight (raising its error, or the renaming's) and for every rank to see it named."""
        self._finish_local(barrier=True)

    def close(self) -> None:
        """Finish the last save, stop the writer, free the staging buffers and the cached plans, destroy the group."""
        try:
            self.wait()
        finally:
            self.writer.shutdown(wait=True)
            self.stager.close()
            self.planner.forget()
            dist.destroy_process_group(self.group)
