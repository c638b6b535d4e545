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

With pp > 1 the same TP -> AC -> FSDP order is applied to each pipeline stage
(``kernels.train_pipeline``), and the loss is sent from the last stage's rank.

Config keys (all optional but the model): model {layers, d_model, heads, vocab,
seq_len, d_ff}; dp, tp, pp, zero, fsdp_strategy, hsdp_replicate, sequence_parallel,
loss_parallel, activation_checkpointing, mixed_precision, cpu_offload,
microbatches, schedule, virtual_stages (pp only); global_batch, steps, lr,
weight_decay, betas, eps, seed; return_params, record_grad_norm (both default
True); world_size (default: every rank) trains on the first world_size ranks only,
the others join the mesh's group creation and return an idle record. Off by default (then
nothing is installed): measure (probe the last step, ``kernels.measure``); pp only: trace,
synthetic_forward_s, ranks_per_host, align_rounds (trace the last step, ``kernels.train_pipeline``).

Records: losses and grad_norms (global, the same on every rank), step_times (this
rank's), layout (coords, strategy, per-parameter global/local shapes and
placements; with pp also stage_ids and stage_layers) and params (this rank's
parameters gathered whole, by name: every parameter, or with pp its stages');
with measure, measure (``kernels.measure``'s record); with trace, trace (events).

Run alone (prints the losses beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train --dp 2 --tp 2 --zero 3
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from kernels.data import microbatches, shard_batch
from kernels.data_parallel import apply_ddp, sync_gradients, unwrap
from kernels.fsdp import apply_fsdp, describe_params, full_parameters
from kernels.measure import measure_record, step_probe
from kernels.mesh import (ParallelDims, build_hsdp_mesh, build_mesh, default_replicate, destroy_mesh_groups,
                          dp_group, dp_rank, dp_world_size)
from kernels.model import build_gpt, loss_fn
from kernels.reference import adamw_kwargs, dataset, model_config, run_settings, train_reference
from kernels.tensor_parallel import apply_tp, loss_context
from kernels.zero import apply_zero1, owned_parameters

_FSDP_ZERO = {"grad_op": 2, "full": 3, "hybrid": 3}


def apply_ac(model: nn.Module, dims: ParallelDims | None = None) -> nn.Module:
    """Recompute each block in backward (``torch.utils.checkpoint``, non-reentrant).

    The block's own ``forward`` is replaced, not wrapped in a new module, so parameter names (and
    checkpoints) stay the same with and without AC. ``dims`` is unused (the ``apply_<x>`` convention).
    """
    for block in model.blocks.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def layout_plan(cfg: dict[str, Any], dims: ParallelDims) -> dict[str, Any]:
    """Resolve the config to one strategy and its options.

    Without pp: "single", "tp", "ddp", "zero1" or "fsdp". With pp > 1 the strategy
    names how gradients meet over dp: "pp" (dp=1), "allreduce" (hand-written, one
    all_reduce per gradient after the schedule), "zero1" or "fsdp" (per stage).
    """
    zero = int(cfg.get("zero", 0))
    strategy = cfg.get("fsdp_strategy")
    if strategy in _FSDP_ZERO and zero == 0:
        zero = _FSDP_ZERO[strategy]
    hybrid = strategy == "hybrid"
    replicate = int(cfg.get("hsdp_replicate") or 0) or default_replicate(dims.dp)
    if zero == 1 and dims.tp > 1:
        raise ValueError("ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters: "
                         "use zero 2/3 with tp > 1")
    if dims.pp > 1:
        return _pipeline_plan(cfg, dims, zero, hybrid, replicate)
    if dims.tp > 1 and dims.dp > 1 and zero < 2:
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


def _pipeline_plan(cfg: dict[str, Any], dims: ParallelDims, zero: int, hybrid: bool, replicate: int) -> dict[str, Any]:
    if cfg.get("loss_parallel"):
        # The schedule computes the loss inside step(); vocab-sharded logits would need
        # loss_parallel() around every stage's backward too.
        raise ValueError("loss_parallel is not supported with pp > 1: the pipeline schedule owns the loss")
    if (cfg.get("mixed_precision") or cfg.get("cpu_offload")) and zero < 2:
        raise ValueError("mixed_precision and cpu_offload are FSDP2 policies: they need zero 2 or 3")
    # Plain DTensor TP gradients can be all-reduced shard by shard, so PP x DP x TP
    # needs no FSDP (unlike the non-pipeline path, which uses DDP).
    kind = "fsdp" if zero >= 2 else "zero1" if zero == 1 else "allreduce" if dims.dp > 1 else "pp"
    return {"kind": kind, "zero": zero, "hybrid": hybrid and zero >= 2, "replicate": replicate if hybrid else 1}


def parallelize(model: nn.Module, cfg: dict[str, Any], dims: ParallelDims, mesh, plan: dict[str, Any],
                dp_mesh=None) -> nn.Module:
    """TP -> AC -> FSDP on a whole GPT or one pipeline stage, in place (order: module docstring).

    ``dp_mesh`` is FSDP's mesh: the 2D HSDP mesh, or by default the mesh's dp axis.
    A stage lacks the embeddings or the head, so TP skips their plan entries.
    """
    if dims.tp > 1:  # 1. TP: DTensors on the tp axis
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Parallelize plan key")  # a stage's missing modules
            apply_tp(model, mesh["tp"], sequence_parallel=bool(cfg.get("sequence_parallel")),
                     loss_parallel=bool(cfg.get("loss_parallel")))
    if cfg.get("activation_checkpointing"):  # 2. AC: per block, inside FSDP's units
        apply_ac(model, dims)
    if plan["kind"] == "fsdp":  # 3. FSDP on the dp axis (2D with TP)
        apply_fsdp(model, dp_mesh if dp_mesh is not None else mesh["dp"], zero_stage=plan["zero"],
                   hybrid=plan["hybrid"], mixed_precision=cfg.get("mixed_precision"),
                   cpu_offload=bool(cfg.get("cpu_offload")))
    return model


def build_layout(cfg: dict[str, Any], dims: ParallelDims, mesh, device: torch.device, dp_mesh=None):
    """Build the model on ``device`` and apply TP -> AC -> FSDP/DDP; returns (model, optimizer, plan, meshes).

    A hybrid plan needs the HSDP mesh: pass it as ``dp_mesh``, or it is built here and returned in ``meshes`` for the caller to destroy.
    """
    plan = layout_plan(cfg, dims)
    settings = run_settings(cfg)
    model = build_gpt(model_config(cfg), device=device)
    extra_meshes = []
    if plan["hybrid"] and dp_mesh is None:
        dp_mesh = build_hsdp_mesh(dims, plan["replicate"], device.type)
        extra_meshes.append(dp_mesh)
    parallelize(model, cfg, dims, mesh, plan, dp_mesh)
    if plan["kind"] in ("ddp", "zero1") and dims.dp > 1:
        model = apply_ddp(model, dims, mesh)
    optimizer = (apply_zero1(unwrap(model), dims, mesh, **adamw_kwargs(settings)) if plan["kind"] == "zero1"
                 else torch.optim.AdamW(model.parameters(), **adamw_kwargs(settings)))
    return model, optimizer, plan, extra_meshes


def train_steps(model: nn.Module, optimizer, cfg: dict[str, Any], dims: ParallelDims, mesh,
                device: torch.device, probe=None) -> tuple[list[float], list[float], list[float]]:
    """Run the optimizer steps on this rank's dp shard; returns (global mean losses, step seconds, grad norms).

    ``probe`` (``kernels.measure.StepProbe``) watches the last step (comm over it; memory after the last
    forward and at rest); with it, gradients are zeroed in place: their buffers exist at the peak.
    """
    settings, data = run_settings(cfg), dataset(cfg)
    n_micro = int(cfg.get("microbatches") or 1)
    lp = bool(cfg.get("loss_parallel")) and dims.tp > 1
    losses, times, norms = [], [], []
    for step in range(settings["steps"]):
        watch = probe if step == settings["steps"] - 1 else None
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T) each
        inputs, targets = shard_batch(inputs, targets, dp_rank(mesh), dp_world_size(mesh))  # (B/dp, T)
        start, local = time.perf_counter(), torch.zeros((), device=device)
        pairs = list(zip(microbatches(inputs, n_micro), microbatches(targets, n_micro)))
        meter = watch.metered if watch else contextlib.nullcontext  # one session per part of the step
        for i, (x, y) in enumerate(pairs):
            with sync_gradients(model, sync=i == len(pairs) - 1), loss_context(lp), meter():
                with watch.forward() if watch and i == len(pairs) - 1 else contextlib.nullcontext():
                    loss = loss_fn(model(x.to(device)), y.to(device)) / n_micro  # mean over this shard's tokens
                loss.backward()
            local += _local_value(loss.detach())
        with meter():
            optimizer.step()
        if watch:
            watch.at_rest()
        if cfg.get("record_grad_norm", True):  # step() leaves .grad alone; here it is outside the meter
            norms.append(grad_norm(model))
        optimizer.zero_grad(set_to_none=probe is None)
        times.append(time.perf_counter() - start)
        # Reporting only: forward all_reduce(SUM) of the shard means over dp, then / dp.
        dist.all_reduce(local, group=dp_group(mesh))
        losses.append(local.item() / dims.dp)
    return losses, times, norms


def grad_norm(model: nn.Module) -> float:
    """The L2 norm of the whole (dp-averaged) gradient, as one process would compute it.

    Sums of squares are taken on local shards and all-reduced once per (mesh, sharded mesh dims)
    group, not once per parameter: ``torch.nn.utils.get_total_norm`` cannot stack norms from the
    different meshes FSDP x TP leaves (dp-only for norms, (dp, tp) for the rest), and a
    ``full_tensor()`` per parameter costs a collective each. Replicated dims are not summed (every
    rank there holds the same values); a Partial gradient is reduced first, as squares of a sum
    are not sums of squares. Plain gradients are whole (DDP) or the same on every tp rank.
    """
    total, groups = 0.0, {}
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            total += float(g.double().pow(2).sum())
            continue
        if any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
        dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())  # Shard, _StridedShard
        key = (g.device_mesh, dims)
        groups[key] = groups.get(key, 0.0) + g.to_local().double().pow(2).sum()
    # Every rank of a group holds the same modules, so each meets the groups in the same order.
    for (mesh, dims), squares in groups.items():
        for d in dims:
            dist.all_reduce(squares, group=mesh.get_group(d))
        total += float(squares)
    return total ** 0.5


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    # Under loss_parallel the loss is a replicated DTensor: every tp rank holds the value.
    return loss.to_local() if isinstance(loss, DTensor) else loss


def train_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train under the layout ``cfg`` names; returns plain records (see module docstring).

    Runs on every rank of the default process group; creates and destroys its own
    mesh sub-groups, so runs on a warm pool leave only the default group behind.
    """
    dims = ParallelDims.from_config(cfg, cfg.get("world_size"))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # Group creation is collective over every rank of the process group, in the mesh or not.
    mesh = build_mesh(dims, device.type)
    plan = layout_plan(cfg, dims)  # a hybrid plan needs the 2D (dp_replicate, dp_shard) mesh
    dp_mesh = build_hsdp_mesh(dims, plan["replicate"], device.type) if plan["hybrid"] else None
    try:
        if mesh.get_coordinate() is None:  # beyond world_size: no part in this run
            return {"losses": [], "grad_norms": [], "step_times": [], "params": {},
                    "layout": {"rank": dist.get_rank(), "strategy": "idle"}}
        if dims.pp > 1:
            from kernels.train_pipeline import train_pipeline  # imports this module: only needed for pp > 1
            return train_pipeline(cfg, dims, mesh, device, dp_mesh)
        model, optimizer, plan, _ = build_layout(cfg, dims, mesh, device, dp_mesh)
        probe = step_probe(cfg, model, optimizer, device)  # None unless cfg["measure"]
        losses, times, norms = train_steps(model, optimizer, cfg, dims, mesh, device, probe)
        inner, rank = unwrap(model), dist.get_rank()
        layout = {"rank": rank, "coords": dims.coords(rank), "strategy": plan["kind"], "zero": plan["zero"],
                  "hybrid": plan["hybrid"], "params": describe_params(inner)}
        if plan["kind"] == "zero1":
            layout["optimizer_params"] = owned_parameters(optimizer, inner)
        # full_parameters is collective for DTensors: every rank gathers, or none does.
        params = ({k: v.tolist() for k, v in full_parameters(inner).items()} if cfg.get("return_params", True)
                  else {})
        out = {"losses": losses, "grad_norms": norms, "step_times": times, "layout": layout, "params": params}
        if probe is not None:  # the measured record beside the layout it measured
            out["measure"] = measure_record(layout, dims, device, probe, loss=losses[-1],
                                            microbatches=int(cfg.get("microbatches") or 1))
        return out
    finally:
        destroy_mesh_groups(mesh, dp_mesh)


def _parse(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="Train the tiny GPT under one layout (run under torchrun).")
    for name, default in (("dp", 1), ("tp", 1), ("pp", 1), ("zero", 0), ("microbatches", 1), ("steps", 3),
                          ("global-batch", 8), ("layers", 2), ("d-model", 32), ("heads", 4), ("d-ff", 64),
                          ("vocab", 64), ("seq-len", 16), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (pp > 1), see kernels.pipeline")
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
