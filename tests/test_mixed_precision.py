"""bf16 reaches every layout: FSDP2's policy where FSDP2 syncs gradients, ``torch.autocast`` elsewhere.

The parity tests (``test_layout_parity``) hold each bf16 layout to the reference's bf16
emulation, but on the tiny model bf16 and fp32 losses differ by less than the bf16
tolerance, so they cannot tell whether a rank computed in bf16 at all. These tests look
at the compute itself: the dtype of the logits a parallelized model returns.
"""
from __future__ import annotations

import pytest

TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}


def _logits_dtype(layout: dict) -> str:
    """On a rank: build the layout's model as train_rank does, run one forward, return the logits' dtype."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from kernels.model.gpt import build_gpt

    from kernels.model.family import model_config
    from kernels.parallel.mesh import build_mesh, destroy_mesh_groups
    from kernels.parallel.parallelize import parallelize
    from kernels.contract.run_config import RunConfig
    from kernels.train.run_build import dims_and_strategy

    run = RunConfig.from_options({"model": TINY, **layout})
    dims, strategy = dims_and_strategy(run, dist.get_world_size())
    mesh = build_mesh(dims, "cpu")
    try:
        model = parallelize(build_gpt(model_config(run)), strategy, mesh)
        logits = model(torch.zeros(2, 16, dtype=torch.long))
        return str((logits.to_local() if isinstance(logits, DTensor) else logits).dtype)
    finally:
        destroy_mesh_groups(mesh, None)


@pytest.mark.parametrize("layout, dtype", [
    ({"dp": 4}, "torch.float32"),
    ({"dp": 4, "mixed_precision": "bf16"}, "torch.bfloat16"),  # DDP + autocast
    ({"dp": 4, "zero": 1, "mixed_precision": "bf16"}, "torch.bfloat16"),  # ZeRO-1 + autocast
    ({"tp": 4, "sequence_parallel": True, "mixed_precision": "bf16"}, "torch.bfloat16"),  # TP/SP + autocast
    ({"dp": 4, "zero": 3, "mixed_precision": "bf16"}, "torch.bfloat16"),  # FSDP2's MixedPrecisionPolicy
], ids=["ddp-fp32", "ddp-bf16", "zero1-bf16", "tp-sp-bf16", "fsdp-bf16"])
def test_bf16_layouts_compute_in_bf16(cluster, layout, dtype):
    assert cluster.run(_logits_dtype, layout) == [dtype] * 4


def test_bf16_is_autocast_exactly_where_fsdp2_does_not_sync():
    from kernels.contract.strategy import resolve_strategy

    def autocast(**layout):
        return resolve_strategy(mixed_precision="bf16", **layout).autocast

    assert autocast(dp=1) and autocast(dp=4) and autocast(dp=4, zero=1) and autocast(tp=4)
    assert autocast(pp=2, dp=2) and autocast(pp=2, dp=2, zero=1)
    assert not autocast(dp=4, zero=2) and not autocast(dp=4, zero=3) and not autocast(pp=2, dp=2, zero=3)
    assert not autocast(dp=2, tp=2)  # TP x DP replicates with FSDP2, so FSDP2's policy applies
