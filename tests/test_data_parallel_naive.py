"""The hand-written gradient averaging (teaching twin) equals DDP and the one-process gradient."""
from __future__ import annotations

from kernels.train.data_parallel_naive import compare_gradient_averaging

CFG = {"model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16}, "global_batch": 8}


def test_naive_averaging_equals_ddp_and_one_process_on_real_gradients(cluster):
    rows = cluster.run(compare_gradient_averaging, CFG)
    assert [r["samples"] for r in rows] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # DistributedSampler order
    assert len({round(r["local_grad_norm"], 6) for r in rows}) == 4  # each rank saw different data
    for r in rows:
        assert r["max_diff_naive_vs_ddp"] < 1e-6
        assert r["max_diff_naive_vs_one_process"] < 1e-6
        assert abs(r["averaged_grad_norm"] - r["one_process_grad_norm"]) < 1e-5 * r["one_process_grad_norm"]
