"""The DDP hook check behind notebook 02's exercise: torch's hook passes it, a hook that forgets to divide does not,
and the bytes a rank writes to its sockets are the ring's 2(n-1)/n of the gradients."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from kernels.measure.socket_bytes import bytes_written
from kernels.train.ddp_hook_check import compare_comm_hook

CFG = {"model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16}, "global_batch": 8}


def _sum_without_divide_hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


@pytest.mark.slow
def test_torch_hook_matches_one_process_and_a_hook_without_the_divide_is_caught(cluster):
    good = cluster.run(compare_comm_hook, CFG, default_hooks.allreduce_hook, bucket_cap_mb=0.05)
    wrong = cluster.run(compare_comm_hook, CFG, _sum_without_divide_hook, bucket_cap_mb=0.05)
    assert [r["samples"] for r in good] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # DistributedSampler order
    psi, ring = good[0]["params"], 2 * 3 / 4
    for r, w in zip(good, wrong):
        assert r["max_diff_vs_allreduce_hook"] == 0 and r["max_diff_vs_one_process"] < 1e-6
        assert sum(r["buckets"]) == psi and len(r["buckets"]) > 1  # rebuilt buckets of at most 0.05 MB
        # gloo's ring sends 2(n-1)/n of the payload, plus a fixed ~1.7 KB of its own per call
        assert ring * 4 * psi <= r["wire_bytes"] <= 1.1 * ring * 4 * psi
        assert w["max_diff_vs_allreduce_hook"] > 1e-4 and w["max_diff_vs_one_process"] > 1e-4
        assert ring * 4 * psi <= w["wire_bytes"] <= 1.1 * ring * 4 * psi  # the same all-reduces: only the divide is missing


def test_bytes_written_grows_by_what_this_process_writes(tmp_path):
    before = bytes_written()
    (tmp_path / "f").write_bytes(b"x" * 10_000)
    after = bytes_written()
    assert before is not None and after - before >= 10_000  # Linux keeps /proc/self/io
