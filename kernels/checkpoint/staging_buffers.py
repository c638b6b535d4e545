"""An async-save stager that copies each save into the CPU buffers of the first one.

Algorithm: ``dcp.async_save`` first stages the state dict (copies it to CPU memory the
training will not touch), then writes the copy in a background thread. DCP's
``DefaultStager`` deep-copies the whole nested dict every time: a Python walk that sends
each DTensor through DTensor's dispatcher, tens of milliseconds for a small GPT's few
hundred entries, all of it on the training thread. Every save of one run holds the same
keys, shapes and shards, so this stager deep-copies once (through ``DefaultStager``) and
afterwards copies only the tensors' local data into that copy (``Tensor.copy_`` on the
local shards) and replaces its plain values (settings, RNG state). A save whose keys or
shapes differ from the first is deep-copied again.

The buffers are reused, so a save may only be staged once the previous one is written;
``kernels.checkpoint.async_save.AsyncSaver`` keeps one save in flight for that reason.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from kernels.parallel.mesh import local_part


def _pairs(fresh: Any, staged: Any, out: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Collect (source, buffer) local tensors of two dicts of one structure into ``out``; False on any difference."""
    if isinstance(fresh, dict):
        if not isinstance(staged, dict) or fresh.keys() != staged.keys():
            return False
        return all(_pairs(fresh[k], staged[k], out) for k in fresh)
    if isinstance(fresh, torch.Tensor):
        if type(fresh) is not type(staged) or (isinstance(fresh, DTensor) and fresh.placements != staged.placements):
            return False
        source, buffer = local_part(fresh), local_part(staged)
        if source.shape != buffer.shape or source.dtype != buffer.dtype:
            return False
        out.append((source, buffer))
        return True
    return not isinstance(staged, (dict, torch.Tensor))


def _replace_plain(fresh: dict, staged: dict) -> None:
    """Put ``fresh``'s non-tensor values (settings, counters) into ``staged``, which has the same keys."""
    for key, value in fresh.items():
        if isinstance(value, dict):
            _replace_plain(value, staged[key])
        elif not isinstance(value, torch.Tensor):
            staged[key] = value


class ReusedStagingBuffers(AsyncStager):
    """Stage a state dict by copying into the buffers of the first one staged (module docstring)."""

    _synchronize_after_execute = False  # staging is done when ``stage`` returns

    def __init__(self) -> None:
        self._full = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        self._staged: dict | None = None
        self.deep_copies = 0  # how many saves needed the full copy (1 in a run whose state keeps its shape)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state_dict`` that the training may go on changing; the same object save after save."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self._staged is None or not _pairs(state_dict, self._staged, pairs):
            self._staged = self._full.stage(state_dict)
            self.deep_copies += 1
            return self._staged
        with torch.no_grad():
            for source, buffer in pairs:
                buffer.copy_(source)
        _replace_plain(state_dict, self._staged)
        return self._staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` copies synchronously."""

    def close(self) -> None:
        """Drop the buffers."""
        self._staged = None
        self._full.close()
