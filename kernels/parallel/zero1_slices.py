"""ZeRO-1 beside TP and PP: each dp rank steps a 1/dp slice of every local shard, then the slices are all-gathered.

Algorithm: ZeRO stage 1 (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC20) on top of tensor and pipeline parallelism, where Megatron-LM's
distributed optimizer puts it (Narayanan et al., 2021): the optimizer state is split over dp on top
of the tp/pp split, so a rank holds K·Ψ/(pp·tp·dp) bytes of it. ``Strategy.zero1_slices`` picks it
wherever no DDP wraps the model: with TP (DTensor parameters) and in pipelines (plain ones too).
Parameters and gradients stay as TP left them (each rank its tp shard, whole over dp), as under
DDP. One step, for each parameter p
whose local tensor L = p.to_local() (this rank's tp shard; the tensor itself when p is plain) holds
n elements, seen flat as (n,):

- before the step (the step function, not this optimizer): each gradient's local shard is
  all-reduced (SUM) over dp and divided by dp (``kernels.train.train_loop.average_gradients``: the
  flat step's, or a pipeline's after its schedule), so the gradient norm, and clipping, see the
  whole averaged gradient, as under DDP;
- step: dp rank r owns the flat elements [r·c, min((r+1)·c, n)), c = ceil(n/dp) (``slice_bounds``,
  torch.chunk's rule: the last ranks may hold fewer). Its slice is a view of L's own storage and its
  gradient the same view of the averaged gradient, so the run's optimizer (AdamW or SGD,
  ``kernels.train.optimizer``) updates that slice of the parameter in place and keeps state for it
  alone;
- all-gather over dp (``dist.all_gather_single``): each rank sends its slice padded to c elements,
  (c,), receives (dp·c,), and copies the first n into L, so every replica holds the updated shard.
  It runs outside autograd: nothing flows back through it.

Traffic per step: the all-reduce (payload Ψ, a ring sends 2Ψ(N-1)/N per rank) and the all-gather
(Ψ(N-1)/N): ZeroRedundancyOptimizer's all-reduce and broadcast, 3Ψ in all. The ZeRO paper's
reduce-scatter (2Ψ in all) would leave each rank the average of its slice only, and then the norm
and the clipping that read the whole gradient would not see it.

Why torch collectives, not FSDP2: ``fully_shard`` keeps the parameters sharded at rest and
reduce-scatters the gradients to shards whatever its ``reshard_after_forward`` says, so after a
step it holds Ψ/N of each: ZeRO-2's memory, not ZeRO-1's whole parameters and gradients. No FSDP2
setting reproduces ZeRO-1 exactly. Why not ZeroRedundancyOptimizer: it hands out whole plain
tensors and broadcasts them (``kernels.parallel.zero1``, which still serves flat DP beside DDP); a
DTensor it refuses, and whole tensors split a pipeline stage's state unevenly (the embedding alone
may be more than 1/dp of it).

Checkpoints (``kernels.checkpoint.save_load``): ``state_dict`` is torch's per-parameter form with
each slice's state all-gathered back into the parameter's local shape and placed as the parameter
is (a DTensor on its mesh), so DCP writes the same logical state as every other layout and any
layout loads it; ``load_state_dict`` keeps this rank's slice of each. The price: a save holds the
local shard's whole state for a moment.

Run alone (TP 2 x DP 2 with ZeRO-1 on 4 ranks, beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 1
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kernels.parallel.mesh import dtensor_like, local_part


def slice_bounds(n: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[start, end) of the flat elements dp rank ``dp_rank`` of ``dp`` owns in a tensor of ``n``: chunks of
    ceil(n/dp), as ``torch.chunk`` cuts (the last ranks may own fewer, or none)."""
    c = math.ceil(n / dp)
    start = min(dp_rank * c, n)
    return start, min(start + c, n)


class OwnedSlice:
    """One parameter's slice that this dp rank steps: ``view`` is (end - start,), a view of the local shard's storage."""

    def __init__(self, param: nn.Parameter, dp_rank: int, dp: int) -> None:
        self.param, self.dp = param, dp
        with torch.no_grad():
            local = local_part(param)
            self.local_shape = local.shape
            self.flat = local.detach().view(-1)  # (n,): the parameter's own storage, so updates land in it
        self.padded = math.ceil(self.flat.numel() / dp)  # c: what each rank sends in the all-gather
        self.start, self.end = slice_bounds(self.flat.numel(), dp, dp_rank)
        self.view = self.flat[self.start:self.end]

    def take_gradient(self) -> None:
        """Point the slice's ``.grad`` at its part of the parameter's (dp-averaged) gradient, or None without one."""
        grad = self.param.grad
        self.view.grad = None if grad is None else local_part(grad).reshape(-1)[self.start:self.end]

    def gathered(self, piece: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Every dp rank's ``piece`` (slice-shaped: the slice itself, or its optimizer state) in rank order, (n,)."""
        send = piece if piece.numel() == self.padded else torch.cat([piece, piece.new_zeros(self.padded - piece.numel())])
        out = piece.new_empty(self.padded * self.dp)  # (dp·c,)
        dist.all_gather_single(out, send.contiguous(), group=group)
        return out[:self.flat.numel()]

    def whole(self, piece: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``piece`` gathered into the parameter's shape, placed as the parameter is (a DTensor on its mesh)."""
        return dtensor_like(self.param, self.gathered(piece, group).view(self.local_shape))

    def mine(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``value``, a state tensor shaped as the parameter (any placements), as a new tensor."""
        p = self.param
        if isinstance(value, DTensor) and isinstance(p, DTensor) and value.placements != p.placements:
            value = value.redistribute(p.device_mesh, p.placements)  # saved or loaded with other placements
        return local_part(value).reshape(-1)[self.start:self.end].clone()


class Zero1SliceOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over any parameters, DTensors included (module docstring): ``optimizer_class`` steps this dp rank's slices.

    ``param_groups`` hold the model's parameters (what ``zero_grad``, learning-rate schedulers, memory
    probes and checkpoints see); ``optim`` is the inner optimizer over the slices, whose ``state`` is
    all the optimizer state this rank holds; ``state`` maps each parameter to its slice's state (the
    same dicts). Gradients must already be averaged over ``dp_group`` when ``step`` runs.
    """

    def __init__(self, params: Iterable[nn.Parameter], dp_group: dist.ProcessGroup,
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **settings: Any) -> None:
        super().__init__(list(params), settings)
        self.dp_group = dp_group
        rank, size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        self.slices = [OwnedSlice(p, rank, size) for group in self.param_groups for p in group["params"]]
        inner_groups, first = [], 0
        for group in self.param_groups:
            inner_groups.append({"params": [s.view for s in self.slices[first:first + len(group["params"])]]})
            first += len(group["params"])
        self.optim = optimizer_class(inner_groups, **settings)
        self._share_state()

    def owned_slices(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """Per parameter name of ``model``: the [start, end) of its flattened local shard whose state this rank holds."""
        bounds = {id(s.param): (s.start, s.end) for s in self.slices}
        return {name: bounds[id(p)] for name, p in model.named_parameters() if id(p) in bounds}

    def _share_state(self) -> None:
        """``state``: each parameter -> its slice's state dict in the inner optimizer (empty until it has one, so
        torch's ``get_state_dict`` knows a fresh optimizer)."""
        inner = self.optim.state
        self.state = defaultdict(dict, {s.param: inner[s.view] for s in self.slices if s.view in inner})

    def _sync_settings(self) -> None:
        """The outer groups' settings (lr, betas, ...: what a scheduler or a checkpoint load changes) into the inner."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's slices with the inner optimizer, then all-gather every parameter's slices over dp."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_settings()
        for s in self.slices:
            s.take_gradient()
        self.optim.step()
        for s in self.slices:  # every rank, every parameter, in one order: the all-gathers pair up
            s.view.grad = None
            s.flat.copy_(s.gathered(s.view, self.dp_group))
        self._share_state()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, each parameter's slice-shaped state gathered whole (collective over dp)."""
        inner = self.optim.state_dict()  # {"state": {index: {name: value}}, "param_groups": [{..., "params": [index]}]}
        state = {i: {name: self.slices[i].whole(v, self.dp_group) if _slice_shaped(v, self.slices[i]) else v
                     for name, v in values.items()} for i, values in inner["state"].items()}
        groups = [{**group, **{k: v for k, v in outer.items() if k != "params"}}
                  for group, outer in zip(inner["param_groups"], self.param_groups)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this rank's slice of each parameter's state (from ``state_dict``'s form, or any layout's: torch's
        ``set_state_dict`` passes names where ids were, in this optimizer's parameter order)."""
        saved_groups = state_dict["param_groups"]
        keys = [k for group in saved_groups for k in group["params"]]
        if len(saved_groups) != len(self.param_groups) or len(keys) != len(self.slices):
            raise ValueError(f"ZeRO-1 optimizer: the state dict has {len(keys)} parameters in {len(saved_groups)} "
                             f"groups, this optimizer {len(self.slices)} in {len(self.param_groups)}")
        state = {i: {name: self.slices[i].mine(v) if _param_shaped(v, self.slices[i]) else v
                     for name, v in state_dict["state"][k].items()}
                 for i, k in enumerate(keys) if k in state_dict["state"]}
        groups, first = [], 0
        for outer, saved in zip(self.param_groups, saved_groups):
            settings = {k: v for k, v in saved.items() if k != "params"}
            outer.update(settings)
            groups.append({**settings, "params": list(range(first, first + len(saved["params"])))})
            first += len(saved["params"])
        self.optim.load_state_dict({"state": state, "param_groups": groups})
        self._share_state()


def _slice_shaped(value: Any, owned: OwnedSlice) -> bool:
    """A per-element state tensor of the slice (exp_avg, a momentum buffer), not a scalar (AdamW's step)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == owned.view.shape


def _param_shaped(value: Any, owned: OwnedSlice) -> bool:
    """A per-element state tensor of the whole parameter, as ``state_dict`` gives it (and every other layout)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == owned.param.shape

