"""Asynchronous checkpoint saves (``checkpoint_async=True``): copied to CPU memory beside the next step, written later.

Algorithm: ``dcp.async_save`` copies the state to CPU memory (into the buffers of the
run's first save: ``kernels.checkpoint.staging_buffers``) and writes it from a background
thread over a separate gloo group; rank 0 renames the checkpoint when its write (which
ends after everyone's) is done. DCP's plan cache is on: the saves of one run after the
first skip gathering and checking the plans again, and hand DCP the first save's tensors
(the live ones, ``kernels.checkpoint.live_payload``) rather than a new state dict, and the
copy to CPU memory skips what the last save's plan gave other ranks to write. What is
written, and how a save is named once whole, are ``kernels.checkpoint.save_load``'s.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from kernels.checkpoint.files import PARTIAL_SUFFIX
from kernels.checkpoint.live_payload import LivePayload
from kernels.checkpoint.save_load import finalize_save
from kernels.checkpoint.staging_buffers import ReusedStagingBuffers


class _CachedPlans(DefaultSavePlanner):
    """DCP's default planner with its plan cache on, under a key of its own, that writes no tensor the stager skipped.

    DCP caches the save plans (and skips gathering the unchanged ones) under the planner's
    key, by default its class name, process-wide: one key per saver keeps a later run of
    another layout on the same warm engine from merging with this one's plans.
    """

    def __init__(self, key: str, stager: ReusedStagingBuffers) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key
        self._stager = stager

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
        # and the stager copies into the CPU buffers of the first save (async_save's own deep-copies each).
        self.stager = ReusedStagingBuffers()
        self.planner = _CachedPlans(f"lab-async-save-{id(self)}", self.stager)
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
            future = dcp.async_save(self.payload(model, optimizer, dist.get_rank()), checkpoint_id=str(partial),
                                    process_group=self.group, planner=self.planner, async_stager=self.stager)
        finally:  # the writer waits for the copy: start it whatever happened
            self.stager.start()
        if not isinstance(future, Future):  # torch >= 2.9 with a stager's future: staging and writing apart
            self.staging, future = future.staging_completion, future.upload_completion
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
        """Finish the last save, free the staging buffers and destroy the group."""
        self.wait()
        self.stager.close()
        dist.destroy_process_group(self.group)
