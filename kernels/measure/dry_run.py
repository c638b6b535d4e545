"""Dry run: build ONE rank's real shard of a large layout in one process, and size it.

Algorithm: the layouts are Megatron-LM 3D parallelism (Narayanan et al., 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") with
FSDP2 on the dp axis (Zhao et al., 2023, "PyTorch FSDP"; ZeRO, Rajbhandari et al., 2020),
applied the way torchtitan applies them. Nothing is trained and nothing is allocated:

- the process group is torch's *fake* backend (``FakeStore`` +
  ``init_process_group("fake", rank=r, world_size=W)``, registered by importing
  ``torch.testing._internal.distributed.fake_pg``): one process plays rank r of a
  1,024-rank world, and every collective is a no-op that "succeeds";
- the model (``kernels.model.llama``) is built on the ``meta`` device: tensors have shapes and
  dtypes but no storage, so a 405B model costs no memory;
- on the (pp, dp, tp) DeviceMesh (tp fastest, docs/design.md#mesh-order), in torchtitan's order:
  PP keeps only this rank's blocks (``keep_layers``); TP shards q/k/v/gate/up
  column-wise (``Shard(0)``) and o/down row-wise (``Shard(1)``), the embedding over the
  vocab rows and the head over the vocab columns (the model's ``tp_plan``); FSDP2
  (``fully_shard``, per block then the root) shards every parameter on dim 0 over dp.
  These are the ranks' own ``kernels.parallel`` functions (``apply_tp``, ``apply_fsdp``,
  ``build_mesh``, ``build_hsdp_mesh``), run on the fake process group.

What is measured: the local shard shape of every parameter (``DTensor.to_local()``),
hence this rank's parameter bytes at rest, and the bytes held before FSDP sharding
(what ZeRO-2 gathers between forward and backward). Gradients and optimizer states do
not exist on meta (no backward or ``step`` runs), so they are *computed* from the same
local shard shapes: gradient bytes = local numel x gradient element size (the parameter
dtype, as FSDP2 keeps it), optimizer bytes = local numel x K (Adam with fp32 master
weights: K = 12; the driver passes K). Under ZeRO-1 the optimizer bytes are the ZeRO
rule numel x K / dp, since ZeroRedundancyOptimizer is not built here.

Run alone (JSON config on stdin, one JSON record on stdout)::

    echo '{"model": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672,
           "vocab": 128256}, "tp": 8, "dp": 4, "pp": 1, "zero": 3, "rank": 0}' | python -m kernels.measure.dry_run
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kernels.contract import layout_rules
from kernels.model.gpt import count_parameters
from kernels.model.llama import Llama, LlamaConfig, build_llama, keep_layers
from kernels.parallel.fsdp import apply_fsdp
from kernels.parallel.mesh import ParallelDims, build_hsdp_mesh, build_mesh
from kernels.parallel.tensor_parallel import apply_tp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fake_process_group(rank: int, world_size: int) -> None:
    """Join a fake world as ``rank``: collectives do nothing, no peer process exists."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _local_shape(p: torch.Tensor) -> list[int]:
    return list(p.to_local().shape) if isinstance(p, DTensor) else list(p.shape)


def local_shapes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: global shape, this rank's local shape, placements and element size."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = {"global": list(p.shape), "local": _local_shape(p), "elem_bytes": p.element_size(),
                     "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else []}
    return out


def _group_rows(shapes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per parameter kind ("blocks.*.attn.q.weight"), blocks folded together."""
    rows: dict[str, dict[str, Any]] = {}
    for name, s in shapes.items():
        kind = re.sub(r"^blocks\.\d+\.", "blocks.*.", name)
        row = rows.setdefault(kind, {"name": kind, "count": 0, "numel": 0, **s})
        row["count"] += 1
        row["numel"] += math.prod(s["local"])
    return list(rows.values())


def _bytes(shapes: dict[str, dict[str, Any]]) -> int:
    """Sum of local numel x element size."""
    return sum(math.prod(s["local"]) * s["elem_bytes"] for s in shapes.values())


def model_states(cfg: dict[str, Any], whole: dict[str, dict], shards: dict[str, dict]) -> dict[str, int]:
    """Parameter bytes measured from shards; gradient and optimizer bytes computed from them."""
    zero, dp = int(cfg.get("zero", 0)), int(cfg.get("dp", 1))
    dtype = cfg.get("dtype", "bf16")
    k = float(cfg.get("optimizer_bytes_per_param", 8 if dtype == "fp32" else 12))
    numel = sum(math.prod(s["local"]) for s in shards.values())
    grad_elem = DTYPES[cfg.get("grad_dtype", dtype)].itemsize
    params_whole = _bytes(whole)
    out = {"local_numel": numel, "params": _bytes(shards), "params_whole": params_whole,
           "grads": numel * grad_elem, "optimizer": int(numel * k)}
    if zero == 1:  # rule, not a shard: ZeroRedundancyOptimizer partitions the state over dp
        out["optimizer"] = int(numel * k / dp)
    # What FSDP2 pads dim 0 to (ceil(s0/dp) rows on every rank), from the pre-FSDP shapes.
    if zero in (2, 3):
        n = dp // int(cfg.get("dp_replicate") or 1)  # ranks one parameter is sharded over (dp_shard)
        out["params_padded"] = sum(math.ceil(s["local"][0] / n) * math.prod(s["local"][1:]) * s["elem_bytes"]
                                   for s in whole.values())
    return out


def _span(r: range) -> list[int]:
    return [r.start, r.stop]  # this stage's blocks: [first, last + 1)


def build_shard(cfg: dict[str, Any]) -> tuple[Llama, dict[str, Any]]:
    """Build rank ``cfg["rank"]``'s shard under the process group already initialised."""
    replicate = cfg.get("dp_replicate")  # HSDP replica groups (None: plain FSDP)
    dims = ParallelDims(dp=int(cfg.get("dp", 1)), tp=int(cfg.get("tp", 1)), pp=int(cfg.get("pp", 1)),
                        world_size=dist.get_world_size(), dp_replicate=int(replicate or 1))
    coords, t0 = dims.coords(dist.get_rank()), time.perf_counter()
    mesh = build_mesh(dims, "cpu")  # on the fake backend groups are created but nothing connects
    dp_mesh = build_hsdp_mesh(dims, "cpu") if replicate else mesh["dp"]
    model = build_llama(LlamaConfig.from_dict(cfg["model"]), "meta", DTYPES[cfg.get("dtype", "bf16")])
    total = count_parameters(model)  # the whole model, before any cut: the shape-derived count
    split = cfg.get("stage_layers")  # blocks per stage, or None: equal stages
    keep_layers(model, coords["pp"], dims.pp, split)  # PP: this rank's stage only
    apply_tp(model, mesh["tp"])
    whole = local_shapes(model)  # after TP and PP, before FSDP: what ZeRO-2 holds whole
    t1 = time.perf_counter()
    if int(cfg.get("zero", 0)) in (2, 3):
        apply_fsdp(model, dp_mesh, zero_stage=int(cfg["zero"]), hybrid=bool(replicate))
    shards = local_shapes(model)
    info = {"rank": dist.get_rank(), "world": dims.world_size, "coords": coords, "model_params": total,
            "layers": _span(layout_rules.layer_split(model.config.layers, dims.pp, coords["pp"], split)),
            "shards": _group_rows(shards), "bytes": model_states(cfg, whole, shards),
            "build_s": t1 - t0, "fsdp_s": time.perf_counter() - t1, "device": "meta", "backend": "fake"}
    return model, info


def dry_run_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Join a fake world as ``cfg["rank"]``, build that rank's shard, and return a plain record.

    ``cfg``: ``model`` (a kernels.model.llama.LlamaConfig dict), ``dp``/``tp``/``pp``, ``rank``,
    ``zero`` (0-3), ``dp_replicate`` (HSDP replica groups, or None), ``dtype`` ("bf16", "fp16", "fp32") and ``optimizer_bytes_per_param`` (K).
    Call it in a throwaway process (``python -m kernels.measure.dry_run``): it owns the process group.
    """
    world = int(cfg.get("dp", 1)) * int(cfg.get("tp", 1)) * int(cfg.get("pp", 1))
    rank = int(cfg.get("rank", 0))
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside the world of dp*tp*pp = {world} ranks")
    start = time.perf_counter()
    fake_process_group(rank, world)
    try:
        _, info = build_shard(cfg)
    finally:
        dist.destroy_process_group()
    info["rank_wall_s"] = time.perf_counter() - start
    return info


def main() -> None:
    """JSON config on stdin; the record as the last line of stdout."""
    record = dry_run_rank(json.loads(sys.stdin.read()))
    sys.stdout.write("\n" + json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
