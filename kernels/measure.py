"""Measure memory and communication of a layout: ``measure_rank(cfg) -> record``.

Algorithm: the layout is built exactly as training builds it (``kernels.train.build_layout``:
TP -> activation checkpointing -> FSDP2/DDP/ZeRO-1, Rajbhandari et al., 2020; Zhao
et al., 2023), then a few plain AdamW steps run with the probes of
``kernels.memory`` and ``kernels.comm`` on the last one (the steady state: optimizer
state exists and DDP has rebuilt its buckets):

- memory at ``peak_fwd_bwd`` (forward done, loss in hand, backward not started) and
  ``at_rest`` (after ``optimizer.step()``, before ``zero_grad``); gradients are zeroed
  with ``set_to_none=False`` so their buffers live across steps, as in the ZeRO formulas;
- communication over the whole step (forward, backward, optimizer step), per
  collective type. DDP is switched to torch's Python ``allreduce_hook`` so its bucket
  all-reduces are seen (same maths as its C++ default).

One micro-batch per step; pp > 1 is not measured here (pipeline stages are built by
``kernels.pipeline``). Config keys are ``kernels.train``'s, plus ``steps`` (default 2).

Record: ``{"rank", "coords", "strategy", "zero", "hybrid", "dims": {dp, tp, pp},
"params": describe_params, "optimizer_params": [names] (ZeRO-1 only), "memory":
{"peak_fwd_bwd": snapshot, "at_rest": snapshot}, "comm": [CommMeter rows],
"comm_debug_counts": {CommDebugMode op: count}, "comm_unmetered": {op: count}, "step_seconds", "loss", "device"}``.

Run alone (ZeRO-3 on 4 ranks, prints rank 0's record)::

    torchrun --nproc-per-node 4 -m kernels.measure --dp 4 --zero 3
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.comm import CommMeter, route_ddp_through_python
from kernels.data import shard_batch
from kernels.data_parallel import unwrap
from kernels.fsdp import describe_params
from kernels.memory import SavedActivations, snapshot
from kernels.mesh import ParallelDims, build_mesh, destroy_mesh_groups, dp_rank, dp_world_size
from kernels.model import loss_fn
from kernels.reference import dataset, run_settings
from kernels.tensor_parallel import loss_context
from kernels.train import build_layout
from kernels.zero import owned_parameters


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def probed_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor, *, loss_parallel: bool,
                device: torch.device, meter: CommMeter | None = None) -> dict[str, Any]:
    """One step with the memory probes at both moments; ``meter`` (if given) spans the whole step."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    metering = meter.active() if meter is not None else _nothing()
    start = time.perf_counter()
    with metering, loss_context(loss_parallel):
        with SavedActivations(model) as acts:
            loss = loss_fn(model(x), y)  # (B*T,) mean over this shard's tokens
        peak = snapshot(model, optimizer, "peak_fwd_bwd", acts.bytes, device)
        loss.backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    rest = snapshot(model, optimizer, "at_rest", None, device)
    optimizer.zero_grad(set_to_none=False)
    value = loss.detach()
    value = value.to_local() if hasattr(value, "to_local") else value
    return {"memory": {"peak_fwd_bwd": peak, "at_rest": rest}, "step_seconds": seconds, "loss": float(value)}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def measure_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build the layout ``cfg`` names, run ``cfg["steps"]`` (default 2) steps, probe the last."""
    dims = ParallelDims.from_config(cfg)
    if dims.pp > 1:
        raise NotImplementedError("measure_rank: pp > 1 is measured by kernels.train's pipeline path")
    device = _device()
    mesh = build_mesh(dims, device.type)
    extra: list = []
    try:
        model, optimizer, plan, extra = build_layout(cfg, dims, mesh, device)
        if isinstance(model, DDP):
            route_ddp_through_python(model)
        settings, data = run_settings(cfg), dataset(cfg)
        steps = max(1, int(cfg.get("steps", 2)))
        lp = bool(cfg.get("loss_parallel")) and dims.tp > 1
        for step in range(steps):
            inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T)
            x, y = shard_batch(inputs, targets, dp_rank(mesh), dp_world_size(mesh))  # (B/dp, T)
            meter = CommMeter() if step == steps - 1 else None
            out = probed_step(model, optimizer, x.to(device), y.to(device), loss_parallel=lp,
                              device=device, meter=meter)
        rank, inner = dist.get_rank(), unwrap(model)
        record = {"rank": rank, "coords": dims.coords(rank), "strategy": plan["kind"], "zero": plan["zero"],
                  "hybrid": plan["hybrid"], "dims": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
                  "params": describe_params(inner), "comm": meter.rows,
                  "comm_debug_counts": meter.debug_counts, "comm_unmetered": meter.unmetered, "device": str(device), **out}
        if plan["kind"] == "zero1":
            record["optimizer_params"] = owned_parameters(optimizer, inner)
        return record
    finally:
        destroy_mesh_groups(mesh, *extra)


def _main() -> None:
    p = argparse.ArgumentParser(description="Measure memory and communication of one layout (torchrun).")
    for name, default in (("dp", 1), ("tp", 1), ("zero", 0), ("steps", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = vars(p.parse_args())
    cfg = {"model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64},
           "global_batch": 8, **a}
    dist.init_process_group("gloo")
    try:
        out = measure_rank(cfg)
        if dist.get_rank() == 0:
            print(json.dumps({k: out[k] for k in ("strategy", "memory", "comm", "comm_debug_counts")}, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
