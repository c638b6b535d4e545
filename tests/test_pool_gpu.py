"""NCCL ranks on real GPUs: one rank per GPU (NCCL refuses two ranks on one GPU)."""
from __future__ import annotations

import pytest
import torch

import lab


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: NCCL ranks need one GPU each; "
                    "the GPU choice itself is covered on CPU by tests/test_rank_map.py")
def test_one_nccl_rank_per_visible_gpu():
    n = torch.cuda.device_count()
    with lab.start(activate=False) as pool:
        assert pool.world_size == n and pool.backend == "nccl"
        assert [r.device for r in pool.rank_map.ranks] == [f"cuda:{i}" for i in range(n)]

        def on_gpu():
            import torch
            import torch.distributed as dist
            t = torch.ones(1, device=torch.cuda.current_device())
            dist.all_reduce(t)
            return t.item(), str(t.device)

        assert pool.run(on_gpu) == [(float(n), f"cuda:{i}") for i in range(n)]
