"""Memory over the traced step: one sample per action (each F/B/I/W of each micro-batch, the all-reduce, the optimizer).

The two snapshots of ``kernels.measure.memory`` (at rest, after forward) say what a step holds at
two moments; a pipeline schedule holds different amounts between them, micro-batch by
micro-batch (1F1B keeps at most p micro-batches' activations where GPipe keeps m). So the
traced step (``kernels.train.step_hooks.PipelineTracer``) also samples memory at the end of each
action, by the same rules as the snapshots:

- parameters, gradients, optimizer state: ``kernels.measure.memory.model_state_bytes`` of this
  rank's stages now;
- activations: the bytes of the unique storages autograd holds for backward *now*. A
  ``saved_tensors_hooks`` pack hook wraps each saved tensor in a ``_Held`` token counted
  per storage; autograd drops the token when it frees the saved tensor (after the
  backward that used it), and the token's finaliser takes the storage's bytes off once
  its last token is gone. Parameters' storages are left out, as in ``SavedActivations``;
- on CUDA, ``torch.cuda.memory_allocated`` beside them (None on CPU).

A sample is taken after the action's own work and before a synthetic cost pads it, so
with ``synthetic_forward_s`` sampling does not move any box; with real compute it adds
the sampling time (a walk over this rank's parameters and optimizer state) to each box.
Times are on the trace recorder's clock, resolved as its events are.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from kernels.measure.memory import local_tensor, model_state_bytes, optimizer_state


class _Held:
    """What autograd keeps in place of a saved tensor while the live count runs (its lifetime is the count's)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear saves its weight's transpose)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class LiveActivations:
    """Bytes of the unique non-parameter storages autograd holds for backward at this instant."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self._tokens: dict[int, int] = {}  # storage key -> live tokens
        self._sizes: dict[int, int] = {}
        self._param_keys: set[int] | None = None  # parameters' storages, looked up once per action

    def forget_parameters(self) -> None:
        """Look the parameters' storages up again at the next save (an action may have resharded them)."""
        self._param_keys = None

    def _parameter_storages(self) -> set[int]:
        # A walk over every parameter per saved tensor cost about a quarter of a forward; once per action is enough,
        # because FSDP2's unsharded parameters are caught by _is_parameter before this.
        if self._param_keys is None:
            self._param_keys = {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        return self._param_keys

    def _pack(self, t: torch.Tensor) -> Any:
        local = local_tensor(t)
        storage = local.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return t
        if key not in self._tokens:
            if _is_parameter(t) or key in self._parameter_storages():
                return t
            self._tokens[key], self._sizes[key] = 0, nbytes
            self.bytes += nbytes
        self._tokens[key] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: int) -> None:
        self._tokens[key] -= 1
        if not self._tokens[key]:
            del self._tokens[key]
            self.bytes -= self._sizes.pop(key)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    @contextlib.contextmanager
    def counting(self) -> Iterator["LiveActivations"]:
        """Count what autograd saves inside the body (tokens saved there are released whenever autograd frees them)."""
        with saved_tensors_hooks(self._pack, self._unpack):
            yield self


class MemorySampler:
    """One rank's memory samples along the traced step (``sample`` at each trace point, ``records`` after)."""

    def __init__(self, model: nn.Module, optimizer: Any, device: torch.device, clock: Any, rank: int) -> None:
        self.model, self.optimizer, self.device, self.clock, self.rank = model, optimizer, device, clock, rank
        self.live = LiveActivations(model)
        self.step = 0
        self._raw: list[tuple[Any, dict[str, Any]]] = []
        self._signature: tuple | None = None
        self._states: dict[str, int] = {}

    def sample(self, kind: str, stage: int | None = None, microbatch: int | None = None, action: str = "") -> None:
        """Record what this rank holds now, after ``kind`` (an action of the trace, or "start")."""
        mark = self.clock.mark()
        signature = self._state_signature()
        if signature != self._signature:  # model states change at few actions: a first backward, the optimizer step
            self._signature, self._states = signature, model_state_bytes(self.model, self.optimizer)
        self.live.forget_parameters()
        cuda = int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else None
        self._raw.append((mark, {
            "rank": self.rank, "kind": kind, "stage": stage, "microbatch": microbatch, "action": action,
            "params": self._states["params"], "grads": self._states["grads"], "optimizer": self._states["optimizer"],
            "activations": self.live.bytes, "cuda_allocated": cuda, "step": self.step}))

    def _state_signature(self) -> tuple:
        """Which tensors hold parameters, gradients and optimizer state now: equal signatures, equal bytes.

        Comparing identities costs a tenth of measuring the bytes (which walks storages and the optimizer's state).
        """
        params = [*self.model.parameters(), *(p for g in self.optimizer.param_groups for p in g["params"])]
        grads = tuple(id(p.grad) if p.grad is not None else 0 for p in params)
        states = tuple(id(v) for s in optimizer_state(self.optimizer).values() for v in s.values())
        return tuple(map(id, params)), grads, states

    def records(self, clock_sync: dict | None = None) -> list[dict[str, Any]]:
        """``kernels.contract.measure_records.MemorySample`` dicts, ``t`` in seconds since rank 0's epoch (as the trace's events)."""
        sync = clock_sync or {"offset": 0.0, "epoch": 0.0}
        shift = sync["offset"] + sync["epoch"]
        return [{**fields, "t": self.clock.resolve(mark) - shift} for mark, fields in self._raw]
