"""An async-save stager that copies each save into the CPU buffers of the first one.

Algorithm: an asynchronous save first stages the state dict (copies it to CPU memory the
training will not touch), then writes the copy in a background thread
(``kernels.checkpoint.async_save``, as ``dcp.async_save`` does). DCP's
``DefaultStager`` deep-copies the whole nested dict every time: a Python walk that sends
each DTensor through DTensor's dispatcher, tens of milliseconds for a small GPT's few
hundred entries, all of it on the training thread. Every save of one run holds the same
keys, shapes and shards, so this stager deep-copies once (through ``DefaultStager``) and
afterwards copies only the tensors' local data into that copy (``Tensor.copy_`` on the
local shards) and replaces its plain values (settings, RNG state). A save whose keys or
shapes differ from the first is deep-copied again.

A rank writes only its share of a save: DCP gives each replicated tensor (every tensor under
DDP, a norm under TP) to one rank. Once the saver knows this rank's share from the last save's
plan (``only``), the later copies skip the tensors another rank writes: under DDP a quarter of
the copying on each of 4 ranks. The stager names what it skipped (``skipped``), and the saver's
planner refuses to write one of those (the plan would have changed since), so a skipped tensor's
stale buffer can never reach a checkpoint.

The copying runs on a thread of its own: ``stage`` returns a future at once, ``start`` (called
once the save has been handed to the writer, so that the copy's Python work does not hold the
GIL while the training thread is still inside the save call) begins the copy, and the training
goes on with its next forward and backward while the copy runs. The training must not change
the parameters or the optimizer state before the future is done: ``AsyncSaver.staged`` waits
for it right before the next optimizer step, and the writer waits for it before writing. The
buffers are reused, so a save may only be staged once the previous one is written;
``AsyncSaver`` keeps one save in flight for that reason.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from kernels.parallel.mesh import local_part


def _pairs(fresh: Any, staged: Any, out: dict[str, tuple[torch.Tensor, torch.Tensor]], key: str = "") -> bool:
    """Collect each tensor's (source, buffer) local tensors of two dicts of one structure into ``out``, under its
    flattened key (DCP's: the dict keys joined by dots); False on any difference."""
    if isinstance(fresh, dict):
        if not isinstance(staged, dict) or fresh.keys() != staged.keys():
            return False
        return all(_pairs(fresh[k], staged[k], out, f"{key}.{k}" if key else str(k)) for k in fresh)
    if isinstance(fresh, torch.Tensor):
        if type(fresh) is not type(staged) or (isinstance(fresh, DTensor) and fresh.placements != staged.placements):
            return False
        source, buffer = local_part(fresh), local_part(staged)
        if source.shape != buffer.shape or source.dtype != buffer.dtype:
            return False
        out[key] = (source, buffer)
        return True
    return not isinstance(staged, (dict, torch.Tensor))


def _replace_plain(fresh: dict, staged: dict) -> None:
    """Put ``fresh``'s non-tensor values (settings, counters) into ``staged``, which has the same keys."""
    for key, value in fresh.items():
        if isinstance(value, dict):
            _replace_plain(value, staged[key])
        elif not isinstance(value, torch.Tensor):
            staged[key] = value


class ReusedStagingBuffers:
    """Stage a state dict by copying into the buffers of the first one staged, on a thread (module docstring)."""

    def __init__(self) -> None:
        self._full = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        self._staged: dict | None = None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lab-checkpoint-staging")
        self._next: tuple[dict[str, Any], Future] | None = None  # staged, not started
        self._wanted: frozenset[str] | None = None  # the flattened keys this rank writes; None: all
        self.skipped: frozenset[str] = frozenset()  # the tensors the last copy left stale (another rank writes them)
        self.deep_copies = 0  # how many saves needed the full copy (1 in a run whose state keeps its shape)

    def only(self, keys: frozenset[str] | None) -> None:
        """Copy only the tensors under these flattened keys from the next save on (None: every tensor)."""
        self._wanted = keys

    def stage(self, state_dict: dict[str, Any]) -> Future:
        """A future of a CPU copy of ``state_dict``, the same object save after save; the copy begins at ``start``,
        and until the future is done the training must not change the tensors ``state_dict`` holds."""
        self._next = (state_dict, Future())
        return self._next[1]

    def start(self) -> None:
        """Begin the copy of the state dict staged last, on the stager's thread (nothing staged: nothing to do)."""
        staged, self._next = self._next, None
        if staged is not None:
            self._copier.submit(self._fill, *staged)

    def _fill(self, state_dict: dict[str, Any], future: Future) -> None:
        try:
            future.set_result(self._copy(state_dict))
        except BaseException as error:  # handed whole to the writer and to ``AsyncSaver.staged``
            future.set_exception(error)

    @torch.no_grad()  # grad mode is per thread: ``to_local`` on a parameter must not record a graph here
    def _copy(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self._staged is None or not _pairs(state_dict, self._staged, pairs):
            self.skipped = frozenset()  # before the copy: a failed one must not look partial
            self._staged = self._full.stage(state_dict)
            self.deep_copies += 1
            return self._staged
        wanted = pairs.keys() if self._wanted is None else self._wanted
        self.skipped = frozenset(pairs.keys() - wanted)
        for key in pairs.keys() & wanted:
            source, buffer = pairs[key]
            buffer.copy_(source)
        _replace_plain(state_dict, self._staged)
        return self._staged

    def close(self) -> None:
        """Finish a copy under way, stop the thread and drop the buffers."""
        self.start()  # a copy never started would leave its writer waiting for good
        self._copier.shutdown(wait=True)
        self._staged = None
        self._full.close()
