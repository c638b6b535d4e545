"""The rank function that trains the GPT under any layout: ``train_rank(cfg) -> records``.

Algorithm: synchronous minibatch AdamW on a 3D (pp, dp, tp) mesh, composed the way
torchtitan's ``parallelize`` composes it (Megatron TP: Shoeybi et al., 2019; ZeRO:
Rajbhandari et al., 2020; PyTorch FSDP: Zhao et al., 2023; activation
recomputation: Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost").
The layout is applied in a fixed order, TP -> activation checkpointing -> FSDP/DDP:

1. TP first: ``parallelize_module`` turns whole ``nn.Linear`` weights into DTensors
   on the tp axis, and must see the original submodules.
2. Activation checkpointing wraps each block's forward, so a block's recompute in
   backward runs the TP collectives again, inside the block.
3. FSDP last: ``fully_shard`` shards whatever parameters it finds (plain tensors, or
   TP DTensors, giving 2D (dp, tp) DTensors) and its hooks surround the recompute.

Every rank builds the same global batch and keeps its dp shard (``shard_batch``);
tp ranks of one dp index see the same samples. The reported loss of a step is the
global-batch mean: the local mean all_reduced (SUM) over the dp group, over dp.

Config keys (all optional but the model): model {layers, d_model, heads, vocab,
seq_len, d_ff}; dp, tp, pp, zero, fsdp_strategy, hsdp_replicate, sequence_parallel,
loss_parallel, activation_checkpointing, mixed_precision, cpu_offload,
microbatches; global_batch, steps, lr, weight_decay, betas, eps, seed;
return_params, record_grad_norm (both default True).

Run alone (prints the losses beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train --dp 2 --tp 2 --zero 3
"""
from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from kernels.data import microbatches, shard_batch
from kernels.data_parallel import apply_ddp, sync_gradients, unwrap
from kernels.fsdp import apply_fsdp, describe_params, full_parameters
from kernels.mesh import (ParallelDims, build_hsdp_mesh, build_mesh, default_replicate, destroy_mesh_groups,
                          dp_group, dp_rank, dp_world_size, pp_group, pp_rank)
from kernels.model import build_gpt, loss_fn
from kernels.reference import adamw_kwargs, dataset, model_config, run_settings, train_reference
from kernels.tensor_parallel import apply_tp, loss_context
from kernels.zero import apply_zero1, owned_parameters

_FSDP_ZERO = {"grad_op": 2, "full": 3, "hybrid": 3}


def apply_ac(model: nn.Module, dims: ParallelDims | None = None) -> nn.Module:
    """Recompute each block in backward (``torch.utils.checkpoint``, non-reentrant).

    The block's own ``forward`` is replaced, not wrapped in a new module, so parameter
    names (and checkpoints) stay the same with and without AC. ``dims`` is unused:
    it is accepted for the ``apply_<technique>(model, dims)`` convention.
    """
    for block in model.blocks.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def layout_plan(cfg: dict[str, Any], dims: ParallelDims) -> dict[str, Any]:
    """Resolve the config to one strategy ("single", "tp", "ddp", "zero1", "fsdp") and its options."""
    zero = int(cfg.get("zero", 0))
    strategy = cfg.get("fsdp_strategy")
    if strategy in _FSDP_ZERO and zero == 0:
        zero = _FSDP_ZERO[strategy]
    hybrid = strategy == "hybrid"
    replicate = int(cfg.get("hsdp_replicate") or 0) or default_replicate(dims.dp)
    if dims.tp > 1 and dims.dp > 1 and zero < 2:
        if zero == 1:
            raise ValueError("ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters: "
                             "use zero 2/3 with tp > 1")
        # DDP cannot take TP DTensors: replicate them with FSDP2 on a (dp, 1) mesh instead.
        zero, hybrid, replicate = 2, True, dims.dp
    if (cfg.get("mixed_precision") or cfg.get("cpu_offload")) and zero < 2:
        raise ValueError("mixed_precision and cpu_offload are FSDP2 policies: they need zero 2 or 3")
    if zero >= 2:
        kind = "fsdp"
    elif zero == 1:
        kind = "zero1"
    else:
        kind = "ddp" if dims.dp > 1 else ("tp" if dims.tp > 1 else "single")
    return {"kind": kind, "zero": zero, "hybrid": hybrid, "replicate": replicate if hybrid else 1}


def build_layout(cfg: dict[str, Any], dims: ParallelDims, mesh, device: torch.device):
    """Build the model on ``device`` and apply TP -> AC -> FSDP/DDP; returns (model, optimizer, plan, meshes)."""
    plan = layout_plan(cfg, dims)
    settings = run_settings(cfg)
    model = build_gpt(model_config(cfg), device=device)
    extra_meshes = []
    if dims.tp > 1:  # 1. TP: DTensors on the tp axis
        apply_tp(model, mesh["tp"], sequence_parallel=bool(cfg.get("sequence_parallel")),
                 loss_parallel=bool(cfg.get("loss_parallel")))
    if cfg.get("activation_checkpointing"):  # 2. AC: per block, inside FSDP's units
        apply_ac(model, dims)
    if plan["kind"] == "fsdp":  # 3. FSDP on the dp axis (2D with TP)
        dp_mesh = mesh["dp"]
        if plan["hybrid"]:
            dp_mesh = build_hsdp_mesh(dims, plan["replicate"], device.type)
            extra_meshes.append(dp_mesh)
        apply_fsdp(model, dp_mesh, zero_stage=plan["zero"], hybrid=plan["hybrid"],
                   mixed_precision=cfg.get("mixed_precision"), cpu_offload=bool(cfg.get("cpu_offload")))
    elif plan["kind"] in ("ddp", "zero1") and dims.dp > 1:
        model = apply_ddp(model, dims, mesh)
    if plan["kind"] == "zero1":
        optimizer = apply_zero1(unwrap(model), dims, mesh, **adamw_kwargs(settings))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(settings))
    return model, optimizer, plan, extra_meshes


def train_steps(model: nn.Module, optimizer, cfg: dict[str, Any], dims: ParallelDims, mesh,
                device: torch.device) -> tuple[list[float], list[float]]:
    """Run the optimizer steps on this rank's dp shard; returns (global mean losses, step seconds, grad norms)."""
    settings = run_settings(cfg)
    data = dataset(cfg)
    n_micro = int(cfg.get("microbatches") or 1)
    lp = bool(cfg.get("loss_parallel")) and dims.tp > 1
    losses, times, norms = [], [], []
    for step in range(settings["steps"]):
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T) each
        inputs, targets = shard_batch(inputs, targets, dp_rank(mesh), dp_world_size(mesh))  # (B/dp, T)
        start = time.perf_counter()
        local = torch.zeros((), device=device)
        pairs = list(zip(microbatches(inputs, n_micro), microbatches(targets, n_micro)))
        for i, (x, y) in enumerate(pairs):
            with sync_gradients(model, sync=i == len(pairs) - 1), loss_context(lp):
                loss = loss_fn(model(x.to(device)), y.to(device)) / n_micro  # mean over this shard's tokens
                loss.backward()
            local += _local_value(loss.detach())
        if cfg.get("record_grad_norm", True):
            norms.append(grad_norm(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        # Reporting only: forward all_reduce(SUM) of the shard means over dp, then / dp.
        dist.all_reduce(local, group=dp_group(mesh))
        losses.append(local.item() / dims.dp)
    return losses, times, norms


def grad_norm(model: nn.Module) -> float:
    """The L2 norm of the whole (dp-averaged) gradient, as one process would compute it.

    For a DTensor gradient the norm is a partial value per shard: ``full_tensor()``
    all_reduces it over the gradient's mesh (one scalar per parameter). Plain
    gradients are whole (DDP) or identical on every tp rank (replicated parameters).
    """
    total = 0.0
    for p in model.parameters():
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad.float() if not isinstance(p.grad, DTensor) else p.grad)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total += float(norm) ** 2
    return total ** 0.5


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    # Under loss_parallel the loss is a replicated DTensor: every tp rank holds the value.
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train under the layout ``cfg`` names; returns plain records (see module docstring).

    Runs on every rank of the default process group; creates and destroys its own
    mesh sub-groups.
    """
    dims = ParallelDims.from_config(cfg)
    device = _device()
    mesh = build_mesh(dims, device.type)
    extra: list = []
    try:
        if dims.pp > 1:
            return _train_pipeline(cfg, dims, mesh, device)
        model, optimizer, plan, extra = build_layout(cfg, dims, mesh, device)
        losses, times, norms = train_steps(model, optimizer, cfg, dims, mesh, device)
        inner = unwrap(model)
        rank = dist.get_rank()
        layout = {"rank": rank, "coords": dims.coords(rank), "strategy": plan["kind"], "zero": plan["zero"],
                  "hybrid": plan["hybrid"], "params": describe_params(inner)}
        if plan["kind"] == "zero1":
            layout["optimizer_params"] = owned_parameters(optimizer, inner)
        full = full_parameters(inner)  # collective for DTensors: every rank gathers
        params = {k: v.tolist() for k, v in full.items()} if cfg.get("return_params", True) else {}
        return {"losses": losses, "grad_norms": norms, "step_times": times, "layout": layout, "params": params}
    finally:
        destroy_mesh_groups(mesh, *extra)


def _train_pipeline(cfg: dict[str, Any], dims: ParallelDims, mesh, device: torch.device) -> dict[str, Any]:
    """pp > 1: kernels.pipeline's stages and schedule, with plain DP across pipeline replicas."""
    from kernels import pipeline  # imported only here: written separately, needed only for pp > 1
    if dims.tp > 1 or int(cfg.get("zero", 0)) or cfg.get("fsdp_strategy"):
        raise NotImplementedError("pp > 1 composes with plain data parallelism only here (tp=1, zero=0)")
    settings, data, dp = run_settings(cfg), dataset(cfg), dp_group(mesh)
    schedule = cfg.get("schedule", "1f1b")
    stages = int(cfg.get("virtual_stages") or (1 if schedule in ("gpipe", "1f1b") else 2))
    runtime = pipeline.build_pipeline(model_config(cfg), schedule, pp_rank(mesh), dims.pp, stages,
                                      int(cfg.get("microbatches") or dims.pp), pp_group(mesh), device, loss_fn)
    params = [p for module in runtime.modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, **adamw_kwargs(settings))
    losses, times = [], []
    for step in range(settings["steps"]):
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T) each
        inputs, targets = shard_batch(inputs, targets, dp_rank(mesh), dims.dp)  # (B/dp, T)
        start = time.perf_counter()
        loss = pipeline.pipeline_step(runtime, inputs, targets)  # float on the last stage, else None
        for p in params:  # naive DP: all_reduce(SUM) of each gradient over the dp group, then / dp
            if dims.dp > 1:
                dist.all_reduce(p.grad, group=dp)
                p.grad /= dims.dp
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        total = torch.tensor(loss or 0.0, device=device)  # only the last stage of each replica adds
        dist.all_reduce(total)
        losses.append(total.item() / dims.dp)
    named = {n: p for module in runtime.modules for n, p in module.named_parameters()}
    rank = dist.get_rank()
    layout = {"rank": rank, "coords": dims.coords(rank), "strategy": f"pp-{schedule}",
              "stage_ids": list(runtime.stage_ids),
              "params": {k: v for module in runtime.modules for k, v in describe_params(module).items()}}
    params_out = {n: p.detach().float().cpu().tolist() for n, p in named.items()} if cfg.get("return_params", True) else {}
    return {"losses": losses, "grad_norms": [], "step_times": times, "layout": layout, "params": params_out}


def _parse(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="Train the tiny GPT under one layout (run under torchrun).")
    for name, default in (("dp", 1), ("tp", 1), ("pp", 1), ("zero", 0), ("microbatches", 1), ("steps", 3),
                          ("global-batch", 8), ("layers", 2), ("d-model", 32), ("heads", 4), ("d-ff", 64),
                          ("vocab", 64), ("seq-len", 16), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--fsdp-strategy", choices=("full", "grad_op", "no_shard", "hybrid"))
    p.add_argument("--mixed-precision", choices=("bf16",))
    for flag in ("sequence-parallel", "loss-parallel", "activation-checkpointing", "cpu-offload"):
        p.add_argument(f"--{flag}", action="store_true")
    a = vars(p.parse_args(argv))
    model = {k: a.pop(k) for k in ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len")}
    return {"model": model, "return_params": False, **a}


def main(argv: list[str] | None = None) -> None:
    cfg = _parse(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    try:
        out = train_rank(cfg)
        if dist.get_rank() == 0:
            ref = train_reference(cfg)["losses"]
            for step, (mine, theirs) in enumerate(zip(out["losses"], ref)):
                print(f"step {step}: loss {mine:.6f}  reference {theirs:.6f}  ({out['step_times'][step]*1e3:.1f} ms)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
