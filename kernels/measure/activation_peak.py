"""The most activations a rank holds at once over a pipeline step, split by the part of the model that saved them.

A pipeline schedule interleaves forwards and backwards, so there is no single moment
between "forward done" and "backward started" to snapshot, as ``kernels.measure.memory``
does for one model. ``PeakActivations`` counts live saved storages as
``kernels.measure.memory_timeline.LiveActivations`` does (a pack hook adds a storage's
bytes when autograd first saves it, a finaliser takes them off when autograd frees the
last saved tensor of it) and remembers the peak of that count, with the split by part
(``kernels.measure.activation_parts.PartTracker``) at that instant. The peak is what
1F1B's "p - stage micro-batches in flight" and GPipe's "all m" are statements about.
Selective checkpointing's cache is not seen here (it is not behind the pack hook).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from kernels.measure.activation_parts import PartTracker
from kernels.measure.memory import local_tensor
from kernels.measure.memory_timeline import LiveActivations


class PeakActivations(LiveActivations):
    """``LiveActivations`` that also keeps ``peak`` (bytes) and ``peak_parts`` (bytes by part at the peak)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.peak = 0
        self.peak_parts: dict[str, int] = {}
        self._parts: dict[str, int] = {}
        self._part_of: dict[int, str] = {}  # storage key -> the part that first saved it
        self._tracker = PartTracker(model)

    def _pack(self, t: torch.Tensor) -> Any:
        before = self.bytes
        packed = super()._pack(t)
        if self.bytes > before:  # a new storage: it belongs to the part running now
            key = local_tensor(t).untyped_storage().data_ptr()
            part = self._part_of[key] = self._tracker.current()
            self._parts[part] = self._parts.get(part, 0) + self.bytes - before
            if self.bytes > self.peak:
                self.peak, self.peak_parts = self.bytes, dict(self._parts)
        return packed

    def _release(self, key: int) -> None:
        before = self.bytes
        super()._release(key)
        if self.bytes < before:
            part = self._part_of.pop(key)
            self._parts[part] -= before - self.bytes

    @contextlib.contextmanager
    def counting(self) -> Iterator["PeakActivations"]:
        """Count what autograd saves in the body, by part; ``peak`` and ``peak_parts`` hold after it."""
        with self._tracker, super().counting():
            yield self
