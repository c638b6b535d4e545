"""What one rank's training really holds in memory, by category (docs/design.md#memory-categories).

Algorithm: the memory accounting of the ZeRO paper (Rajbhandari et al., 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", §3): *model states*
(parameters, gradients, optimizer states) and *residual states* (activations saved
for backward), measured on the tensors this rank holds rather than drawn from a formula.

How each category is counted (``model_state_bytes``):

- a tensor's bytes are ``numel * element_size`` of this rank's *local* tensor: a
  DTensor (FSDP2 shard, TP shard) counts ``to_local()``; each distinct tensor once.
  ``*_storage`` beside it counts the unique storages behind those tensors, which
  includes FSDP2's dim-0 padding (each shard is stored padded to ceil(dim0/N) rows).
- parameters: the tensors registered as the model's parameters *now*. FSDP2 swaps the
  registered tensor: a sharded DTensor at rest, the whole (all-gathered) tensor while a
  unit is unsharded, so ZeRO-2 (``reshard_after_forward=False``) shows whole parameters
  between forward and backward and ZeRO-3 shows shards. (While unsharded, FSDP2 also
  keeps the shard itself: ``param_shards_unregistered``, not counted in parameters.)
- gradients: ``p.grad`` of those parameters and of the optimizer's (DDP and ZeRO-1:
  whole; FSDP2: shards, which hang on the sharded DTensors even while a unit is whole),
  and, while FSDP2 accumulates without reducing, the whole gradients it keeps beside them.
- optimizer: every tensor in the optimizer's state: for ``ZeroRedundancyOptimizer``
  its inner optimizer's state, i.e. only this rank's partition. AdamW holds exp_avg and
  exp_avg_sq (K = 8 bytes per fp32 element) plus a ``step`` scalar per parameter
  tensor (4 bytes each), reported apart as ``optimizer_step_scalars`` and included.

The two moments (``kernels.train.measured_run`` takes them with ``zero_grad(set_to_none=False)``,
so gradient buffers live across steps, as the ZeRO formulas assume):

- ``at_rest``: after ``backward`` and ``optimizer.step()``, before ``zero_grad``;
  every model state exists and is in its resting (sharded) form.
- ``peak_fwd_bwd``: after forward has returned the loss, before ``loss.backward()``:
  every activation saved for backward is alive, and ZeRO-2 holds whole parameters.

Activations (``SavedActivations``): a ``torch.autograd.graph.saved_tensors_hooks``
pack hook sees every tensor autograd saves in forward; the bytes of the unique
storages behind them, leaving out parameters' storages, are the activations held at
the end of forward (autograd keeps them all until backward uses them); ``parts`` splits them by
the part of the model that saved them (``kernels.measure.activation_parts``). Under selective
checkpointing the outputs its policy keeps live in its own cache, not behind the hook: its
policy shows them to ``SavedActivations`` (``observe_selective_saves``). On CUDA the
allocator's own figures are reported beside them (``None`` on CPU):
``torch.cuda.memory_allocated`` at the moment (``cuda_allocated``: every live tensor,
the tensors counted above included) and ``torch.cuda.max_memory_allocated`` since the
measured step began (``cuda_max_allocated``). Part of ``cuda_allocated`` is no tensor of the
model's: cuBLAS keeps a workspace per stream in the caching allocator (32 MiB each on Hopper);
``cuda_workspaces`` is what freeing them releases at that moment (a later matmul takes them back
from the allocator's cache).

Run alone (one rank, prints both moments for the tiny GPT)::

    python -m kernels.measure.memory
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from kernels.measure.activation_parts import PartTracker
from kernels.parallel.fsdp import unsharded_grads
from kernels.parallel.activation_checkpoint import observe_selective_saves


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself. A collective's result still in
    flight (``AsyncCollectiveTensor``, a wrapper without storage of its own) is waited for: its storage is the
    one counted."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """Logical bytes (each distinct local tensor once) and the bytes of their unique storages."""
    seen_tensors: set[tuple] = set()
    seen_storages: dict[int, int] = {}
    total = 0
    for t in tensors:
        local = local_tensor(t)
        key = (local.data_ptr(), tuple(local.shape), local.dtype)
        if key in seen_tensors:
            continue
        seen_tensors.add(key)
        total += local.numel() * local.element_size()
        seen_storages[_storage_key(local)] = local.untyped_storage().nbytes()
    return {"bytes": total, "storage": sum(seen_storages.values())}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    """The state this rank really holds: a ZeroRedundancyOptimizer's inner (partition) state."""
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer wraps the local AdamW
    return (inner if inner is not None else optimizer).state


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank now.

    Gradients are read from the optimizer's parameters as well as the registered ones:
    while FSDP2 has a unit unsharded (ZeRO-2 between forward and backward), the sharded
    gradients hang on the sharded DTensors the optimizer holds, not on the registered
    whole tensors; during gradient accumulation FSDP2 also holds whole gradients that no
    registered parameter shows (``kernels.parallel.fsdp.unsharded_grads``). ``param_shards_unregistered``
    counts those sharded parameters while they are not registered (FSDP2 keeps them beside the whole ones).
    """
    params = list(model.parameters())
    registered = {id(x) for x in params}
    resting = [x for group in optimizer.param_groups for x in group["params"]]
    hidden = [x for x in resting if id(x) not in registered]
    p = tensor_bytes(params)
    g = tensor_bytes([x.grad for x in params + hidden if x.grad is not None] + unsharded_grads(model))
    moments, steps = [], []
    for state in optimizer_state(optimizer).values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                (steps if name == "step" else moments).append(value)
    o = tensor_bytes(moments)
    s = tensor_bytes(steps)
    return {"params": p["bytes"], "grads": g["bytes"], "optimizer": o["bytes"] + s["bytes"],
            "optimizer_step_scalars": s["bytes"], "param_shards_unregistered": tensor_bytes(hidden)["bytes"],
            "params_storage": p["storage"],
            "grads_storage": g["storage"], "optimizer_storage": o["storage"] + s["storage"],
            "param_tensors": len(params), "optimizer_tensors": len(moments) + len(steps)}


class SavedActivations:
    """Context manager: bytes of the unique storages autograd saves for backward, parameters left out.

    Parameters are recognised by storage, looked up when a tensor is saved, so FSDP2's
    unsharded parameters (registered only while their unit runs) are left out too.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.storages: dict[int, int] = {}
        self.parts: dict[str, int] = {}  # the same bytes by the part of the model that saved them
        self.saved = 0  # how many tensors autograd saved (views of one storage counted apart)
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self._tracker = PartTracker(model)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved += 1
        self._count(t)
        return t

    def _kept_by_selective(self, output: Any) -> None:
        """Selective checkpointing keeps these op outputs in its own cache, unseen by the pack hook: count them too."""
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                self.saved += 1
                self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        local = local_tensor(t)
        nbytes = local.untyped_storage().nbytes()
        key = _storage_key(local)
        if nbytes and key not in self.storages:
            params = {_storage_key(local_tensor(p)) for p in self.model.parameters()}
            if key not in params:
                self.storages[key] = nbytes
                part = self._tracker.current()
                self.parts[part] = self.parts.get(part, 0) + nbytes

    def __enter__(self) -> "SavedActivations":
        self._tracker.__enter__()
        self._hooks.__enter__()
        self._selective = observe_selective_saves(self._kept_by_selective)
        self._selective.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._selective.__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._tracker.__exit__(*exc)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, moment: str,
             activations: int | None = None, device: torch.device | None = None,
             activation_parts: dict[str, int] | None = None) -> dict[str, Any]:
    """One memory record: the model states now, the saved activations (and by part, where counted) and, on CUDA,
    the allocator's now and peak."""
    out: dict[str, Any] = {"moment": moment, **model_state_bytes(model, optimizer), "activations": activations}
    if activation_parts is not None:
        out["activation_parts"] = dict(activation_parts)
    cuda = device is not None and device.type == "cuda"
    out["cuda_allocated"] = int(torch.cuda.memory_allocated(device)) if cuda else None
    out["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    out["cuda_workspaces"] = cublas_workspace_bytes(device) if cuda else None
    return out


def cublas_workspace_bytes(device: torch.device) -> int:
    """Bytes of ``torch.cuda.memory_allocated`` that are cuBLAS workspaces, found by freeing them now."""
    before = torch.cuda.memory_allocated(device)
    torch._C._cuda_clearCublasWorkspaces()
    return int(before - torch.cuda.memory_allocated(device))


def _main() -> None:
    from kernels.model.gpt import GPTConfig, build_gpt, loss_fn
    model = build_gpt(GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16, d_ff=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (8, 16))
    for step in range(2):
        with SavedActivations(model) as acts:
            loss = loss_fn(model(x), x)
        peak = snapshot(model, opt, "peak_fwd_bwd", acts.bytes, activation_parts=acts.parts)
        loss.backward()
        opt.step()
        rest = snapshot(model, opt, "at_rest")
        opt.zero_grad(set_to_none=False)
    print(peak, rest, sep="\n")


if __name__ == "__main__":
    _main()
