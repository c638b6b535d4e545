"""Rank function ``trace_pipeline_step(cfg) -> records``: one measured pipeline step per rank.

Builds this rank's stages with ``kernels.pipeline.build_pipeline`` on a (pp, dp, tp=1)
mesh (DESIGN §3 "Mesh order"), runs untraced warm-up steps (the first step also
infers shapes with extra p2p), aligns the clocks to rank 0 (barrier round trips,
``kernels.trace.align_clocks``), then traces ``steps`` steps: the schedule's actions
and p2p waits (``kernels.trace.instrument``), the naive dp gradient all-reduce
(all_reduce(SUM) over the dp group, then / dp, as kernels.train does) and the AdamW
step. With ``synthetic_forward_s`` set, every action is padded to a fixed cost
(``kernels.synthetic``) so the measured bubble can be compared with theory (GPipe:
Huang et al., 2019; 1F1B: Narayanan et al., 2019; interleaved: Narayanan et al., 2021;
zero bubble: Qi et al., 2024).

Config keys: schedule, pp, dp (default world // pp), stages_per_rank (1 for gpipe/1f1b,
else 2), microbatches, model {layers, d_model, heads, vocab, seq_len}, global_batch,
synthetic_forward_s (None: real compute), steps (traced, default 1), warmup_steps
(default 1), align_rounds (default 4), seed.

Run alone (prints each rank's busy time and idle share of the traced step)::

    torchrun --nproc-per-node 4 -m kernels.pipeline_trace 1f1b 4 8 0.02
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from kernels.data import SyntheticTokens, shard_batch
from kernels.mesh import ParallelDims, build_mesh, destroy_mesh_groups, dp_group, dp_rank, pp_group, pp_rank
from kernels.model import loss_fn
from kernels.pipeline import SINGLE_STAGE, PipelineRuntime, build_pipeline, pipeline_step
from kernels.synthetic import SyntheticCost, oversubscription_warning
from kernels.trace import COMPUTE_KINDS, TraceRecorder, align_clocks, traced

DEFAULT_MODEL = {"layers": 4, "d_model": 16, "heads": 2, "vocab": 32, "seq_len": 8}


def planned_compute_order(runtime: PipelineRuntime, pp_rank_: int) -> list[list] | None:
    """Torch's planned compute actions for this rank as [stage, "F"|"B"|"I"|"W", microbatch].

    ``schedule.pipeline_order`` is private (DESIGN §4b) and, for GPipe and 1F1B in torch
    2.8-2.13, wrong; the driver builds its own for those. None when torch has none.
    """
    try:
        order = getattr(runtime.schedule, "pipeline_order", None)
        actions = order.get(pp_rank_) if order else None
        if actions is None:
            return None
        out: list[list] = []
        for action in actions:
            for sub in (action.sub_actions or (action,)) if action is not None else ():
                letter = getattr(sub.computation_type, "value", str(sub.computation_type))
                if letter in ("F", "B", "I", "W"):
                    out.append([int(sub.stage_index), letter, int(sub.microbatch_index)])
        return out
    except (AttributeError, TypeError, ValueError):
        return None


def _dp_all_reduce(params: list[torch.nn.Parameter], group: Any, dp: int, rec: TraceRecorder | None) -> None:
    """Sum the flat gradient over the dp group (one all_reduce), then / dp: the replicas' mean."""
    grads = [p.grad for p in params if p.grad is not None]
    if dp == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numel,)
    if rec is None:
        dist.all_reduce(flat, group=group)
    else:
        with rec.span("all_reduce", nbytes=flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for g in grads:  # copy the mean back into each .grad
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _one_step(runtime: PipelineRuntime, batch: tuple, params: list, opt: Any, dp_info: tuple,
              rec: TraceRecorder | None, synthetic: SyntheticCost | None) -> None:
    if rec is None:
        pipeline_step(runtime, *batch)
    else:
        with traced(runtime.stages, rec, synthetic):
            pipeline_step(runtime, *batch)
    _dp_all_reduce(params, *dp_info, rec)
    if rec is None:
        opt.step()
    else:
        with rec.span("optimizer"):
            opt.step()
    opt.zero_grad(set_to_none=True)


def _settings(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    schedule = cfg.get("schedule", "1f1b")
    pp = int(cfg.get("pp", world))
    spr = int(cfg.get("stages_per_rank") or (1 if schedule in SINGLE_STAGE else 2))
    m = int(cfg.get("microbatches", pp))
    model = {**DEFAULT_MODEL, **cfg.get("model", {})}
    model["layers"] = max(model["layers"], pp * spr)  # at least one block per stage
    return {"schedule": schedule, "pp": pp, "dp": int(cfg.get("dp", world // pp)), "spr": spr, "m": m,
            "model": model, "batch": int(cfg.get("global_batch", m * int(cfg.get("dp", world // pp)))),
            "synthetic_s": cfg.get("synthetic_forward_s"), "steps": int(cfg.get("steps", 1)),
            "warmup": int(cfg.get("warmup_steps", 1)), "rounds": int(cfg.get("align_rounds", 4))}


def trace_pipeline_step(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every rank of the default group: trace ``steps`` pipeline steps; returns plain records."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s = _settings(cfg, world)
    dims = ParallelDims(dp=s["dp"], tp=1, pp=s["pp"], world_size=world)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    synthetic = SyntheticCost(float(s["synthetic_s"]), s["spr"]) if s["synthetic_s"] else None
    warning = oversubscription_warning(int(os.environ.get("LOCAL_WORLD_SIZE", world)), synthetic is not None)
    mesh = build_mesh(dims, device.type)
    try:
        runtime = build_pipeline(s["model"], s["schedule"], pp_rank(mesh), s["pp"], s["spr"], s["m"],
                                 pp_group(mesh), device, loss_fn)
        params = [p for module in runtime.modules for p in module.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        data = SyntheticTokens(s["model"]["vocab"], s["model"]["seq_len"], seed=int(cfg.get("seed", 0)))
        batches = [shard_batch(*data.global_batch(i, s["batch"]), dp_rank(mesh), s["dp"])
                   for i in range(s["warmup"] + s["steps"])]
        dp_info = (dp_group(mesh), s["dp"])
        for batch in batches[:s["warmup"]]:
            _one_step(runtime, batch, params, opt, dp_info, None, None)
        sync = align_clocks(s["rounds"], device)
        rec = TraceRecorder(rank, device, cpu_clock=synthetic is not None)  # sleeps are CPU time
        for step, batch in enumerate(batches[s["warmup"]:]):
            rec.step = step
            dist.barrier()  # every rank starts the step together
            _one_step(runtime, batch, params, opt, dp_info, rec, synthetic)
        return {"rank": rank, "pp_rank": pp_rank(mesh), "dp_rank": dp_rank(mesh), "schedule": s["schedule"],
                "pp": s["pp"], "dp": s["dp"], "stages_per_rank": s["spr"], "microbatches": s["m"],
                "stage_ids": list(runtime.stage_ids), "num_stages": runtime.num_stages,
                "device": str(device), "synthetic": synthetic is not None,
                "synthetic_cost": synthetic.summary() if synthetic else None,
                "events": rec.events(sync), "clock": sync,
                "planned": planned_compute_order(runtime, pp_rank(mesh)),
                "warnings": [warning] if warning else []}
    finally:
        destroy_mesh_groups(mesh)


def _main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    schedule, pp, m = argv[0] if argv else "1f1b", *(int(a) for a in (argv[1:3] or ["2", "4"]))
    synthetic = float(argv[3]) if len(argv) > 3 else None
    out = trace_pipeline_step({"schedule": schedule, "pp": pp, "microbatches": m, "synthetic_forward_s": synthetic})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out["events"])
    if dist.get_rank() == 0:
        compute = [e for events in gathered for e in events if e["kind"] in COMPUTE_KINDS]
        makespan = max(e["end"] for e in compute) - min(e["start"] for e in compute)
        for r, events in enumerate(gathered):
            busy = sum(e["end"] - e["start"] for e in events if e["kind"] in COMPUTE_KINDS)
            print(f"rank {r}: busy {busy:.3f} s of {makespan:.3f} s, idle {1 - busy / makespan:.3f}")
        print(f"theory (p-1)/(m+p-1) = {(pp - 1) / (m + pp - 1):.3f}; clock ± {out['clock']['uncertainty']:.2e} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _main(sys.argv[1:])
