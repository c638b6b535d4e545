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

One micro-batch per step without pp. With pp > 1 (``measure_pipeline``) this rank's
stages are built by ``kernels.pipeline.build_pipeline`` with the same TP -> AC -> FSDP
transform as training, a whole schedule step runs (m micro-batches), and only the
``at_rest`` moment is taken: forward and backward interleave inside the schedule, so
there is no single moment between them. Stage-boundary p2p is metered at the stage
(``PipelineStage.get_{fwd,bwd}_send_ops``, the tensors each send carries): torch's
``P2POp`` rejects a wrapped ``dist.isend``, so the namespace patch leaves p2p alone
here (``_CollectiveMeter``). Config keys are ``kernels.train``'s, plus ``steps`` (default 2).

Record: ``{"rank", "coords", "strategy", "zero", "hybrid", "dims": {dp, tp, pp},
"params": describe_params, "optimizer_params": [names] (ZeRO-1 only), "memory":
{"peak_fwd_bwd": snapshot, "at_rest": snapshot}, "comm": [CommMeter rows],
"comm_debug_counts": {CommDebugMode op: count}, "comm_unmetered": {op: count}, "step_seconds", "loss", "device"}``;
with pp also ``"stage_ids", "num_stages", "microbatches", "micro_batch"`` (memory: ``at_rest`` only).

Run alone (ZeRO-3 on 4 ranks, prints rank 0's record)::

    torchrun --nproc-per-node 4 -m kernels.measure --dp 4 --zero 3
    torchrun --nproc-per-node 4 -m kernels.measure --dp 2 --pp 2
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels import pipeline
from kernels.comm import _DIST_OPS, _P2P, CommMeter, route_ddp_through_python
from kernels.data import shard_batch
from kernels.data_parallel import unwrap
from kernels.fsdp import describe_params
from kernels.memory import SavedActivations, snapshot
from kernels.mesh import (
    ParallelDims,
    build_hsdp_mesh,
    build_mesh,
    destroy_mesh_groups,
    dp_group,
    dp_rank,
    dp_world_size,
    pp_group,
    pp_rank,
)
from kernels.model import loss_fn
from kernels.reference import adamw_kwargs, dataset, model_config, run_settings
from kernels.tensor_parallel import loss_context
from kernels.train import build_layout, layout_plan, parallelize
from kernels.train_pipeline import average_gradients
from kernels.zero import apply_zero1, owned_parameters


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
    """Build the layout ``cfg`` names, run ``cfg["steps"]`` (default 2) steps, probe the last (pp > 1: ``measure_pipeline``)."""
    dims = ParallelDims.from_config(cfg)
    device = _device()
    mesh = build_mesh(dims, device.type)
    extra: list = []
    try:
        if dims.pp > 1:
            return measure_pipeline(cfg, dims, mesh, device, extra)
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


class _CollectiveMeter(CommMeter):
    """A CommMeter for pipeline steps: ``torch.distributed`` collectives only.

    p2p is left unpatched: ``P2POp`` checks ``op`` by identity against the unwrapped
    ``isend``/``irecv``, so a wrapped one breaks the pipeline's sends (they are counted
    at the stage instead, ``meter_stage_sends``). DTensor functional collectives are not
    metered: CommDebugMode's module tracker fails inside the schedule's stage calls
    (IndexError in ``_fw_set_module_hook``), so TP inside a pipeline goes unmetered here.
    """

    @contextlib.contextmanager
    def active(self):
        names = [n for n in _DIST_OPS if n not in _P2P and hasattr(dist, n)]
        originals = {n: getattr(dist, n) for n in names}
        for n in names:
            setattr(dist, n, self._wrap(n, originals[n]))
        try:
            yield self
        finally:
            for n, fn in originals.items():
                setattr(dist, n, fn)
        self.debug_counts, self.unmetered = {}, {}


def meter_stage_sends(stage, meter: CommMeter) -> None:
    """Count every stage-boundary send of ``stage`` into ``meter`` (op "send", group size 2).

    Wraps the instance's ``get_fwd_send_ops`` (activations to the next stage) and
    ``get_bwd_send_ops`` (input gradients to the previous one): the payload is each
    op's tensor, (b, T, C) here. Time is not known at that point and is left 0.
    """
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        original = getattr(stage, name)

        def wrapped(chunk_id: int, _original=original) -> list:
            ops = _original(chunk_id)
            for op in ops:
                meter.record("send", 2, op.tensor.numel() * op.tensor.element_size(), 0.0, "pipeline")
            return ops
        setattr(stage, name, wrapped)


def measure_pipeline(cfg: dict[str, Any], dims: ParallelDims, mesh, device: torch.device,
                     extra: list) -> dict[str, Any]:
    """pp > 1: this rank's stages as training builds them; model states at rest, comm over the last step."""
    plan = layout_plan(cfg, dims)
    if plan["hybrid"]:
        extra.append(build_hsdp_mesh(dims, plan["replicate"], device.type))
    schedule = cfg.get("schedule", "1f1b")
    per_rank = int(cfg.get("virtual_stages") or (1 if schedule in pipeline.SINGLE_STAGE else 2))
    m = int(cfg.get("microbatches") or dims.pp)
    transform = functools.partial(parallelize, cfg=cfg, dims=dims, mesh=mesh, plan=plan,
                                  dp_mesh=extra[0] if extra else None)
    runtime = pipeline.build_pipeline(model_config(cfg), schedule, pp_rank(mesh), dims.pp, per_rank, m,
                                      pp_group(mesh), device, loss_fn, model_transform=transform)
    stack = nn.ModuleList(runtime.modules)  # this rank's stages as one module
    settings, data = run_settings(cfg), dataset(cfg)
    optimizer = (apply_zero1(stack, dims, mesh, **adamw_kwargs(settings)) if plan["kind"] == "zero1"
                 else torch.optim.AdamW(stack.parameters(), **adamw_kwargs(settings)))
    meter, steps = _CollectiveMeter(), max(1, int(cfg.get("steps", 2)))
    for step in range(steps):
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T)
        inputs, targets = shard_batch(inputs, targets, dp_rank(mesh), dims.dp)  # (B/dp, T)
        if step == steps - 1:
            for stage in runtime.stages:
                meter_stage_sends(stage, meter)
        start = time.perf_counter()
        with meter.active() if step == steps - 1 else _nothing():
            pipeline.pipeline_step(runtime, inputs, targets)
            if plan["kind"] in ("allreduce", "zero1") and dims.dp > 1:
                average_gradients(stack, dp_group(mesh))  # one all_reduce per gradient, as training does
            optimizer.step()
        seconds = time.perf_counter() - start
        rest = snapshot(stack, optimizer, "at_rest", None, device)
        optimizer.zero_grad(set_to_none=False)
    rank = dist.get_rank()
    record = {"rank": rank, "coords": dims.coords(rank), "strategy": plan["kind"], "zero": plan["zero"],
              "hybrid": plan["hybrid"], "dims": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
              "params": {k: v for mod in runtime.modules for k, v in describe_params(mod).items()},
              "stage_ids": list(runtime.stage_ids), "num_stages": runtime.num_stages, "microbatches": m,
              "micro_batch": settings["global_batch"] // (dims.dp * m), "memory": {"at_rest": rest},
              "comm": meter.rows, "comm_debug_counts": meter.debug_counts, "comm_unmetered": meter.unmetered,
              "step_seconds": seconds, "loss": None, "device": str(device)}
    if plan["kind"] == "zero1":  # ModuleList names are "<index>.<parameter name>"
        record["optimizer_params"] = [n.split(".", 1)[1] for n in owned_parameters(optimizer, stack)]
    return record


def _main() -> None:
    p = argparse.ArgumentParser(description="Measure memory and communication of one layout (torchrun).")
    for name, default in (("dp", 1), ("tp", 1), ("pp", 1), ("zero", 0), ("steps", 2), ("microbatches", 0)):
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
