"""Pipeline p2p staged through host copies (for gloo ranks sharing a GPU) trains bit for bit like direct p2p.

On CPU ranks nothing needs staging, so ``stage_all`` forces every transfer through a fresh
host buffer: the rewriting of the schedule's ops (sizes, peers, tags, the copy back on wait)
is what these tests check; on a GPU the same rewriting only adds the device copies.
"""
from __future__ import annotations

import pytest


def _step_twice(schedule: str, stages_per_rank: int) -> dict:
    """On a rank of a PP 4 pipeline: one step with direct p2p, one staged; returns both losses and gradients."""
    import torch
    import torch.distributed as dist

    from kernels.model.gpt import GPTConfig, loss_fn
    from kernels.parallel.p2p_staging import staged_p2p
    from kernels.parallel.pipeline import build_pipeline, pipeline_step

    rank = dist.get_rank()
    cfg = GPTConfig(layers=4 * stages_per_rank, d_model=16, heads=2, vocab=32, seq_len=8)
    x = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for staged in (False, True):
        rt = build_pipeline(cfg, schedule, rank, 4, stages_per_rank, 8, dist.group.WORLD, torch.device("cpu"), loss_fn)
        with staged_p2p(stage_all=staged):
            loss = pipeline_step(rt, x, x)
        grads = [p.grad.clone() for m in rt.modules for p in m.parameters()]
        out[staged] = (None if loss is None else loss.item(), grads)
    return {"same_loss": out[False][0] == out[True][0], "has_loss": out[False][0] is not None,
            "same_grads": all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1])),
            "grads": len(out[False][1])}


@pytest.mark.parametrize("schedule, stages_per_rank", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_staged_pipeline_step_equals_direct_p2p(cluster, schedule, stages_per_rank):
    rows = cluster.run(_step_twice, schedule, stages_per_rank)
    assert all(r["same_loss"] and r["same_grads"] and r["grads"] > 0 for r in rows), rows
    assert sum(r["has_loss"] for r in rows) == 1  # one rank holds the last stage


def test_staging_is_chosen_for_gloo_on_a_gpu_only(cluster):
    def choices():
        import torch
        import torch.distributed as dist

        from kernels.parallel.p2p_staging import needs_staging
        return (needs_staging(torch.device("cuda", 0), dist.group.WORLD),  # gloo on a GPU
                needs_staging(torch.device("cpu"), dist.group.WORLD))
    assert cluster.run(choices) == [(True, False)] * 4


def test_staging_restores_torchs_p2p_function():
    from torch.distributed.pipelining import schedules

    from kernels.parallel.p2p_staging import staged_p2p

    original = schedules._batch_p2p
    with pytest.raises(RuntimeError):
        with staged_p2p():
            assert schedules._batch_p2p is not original
            raise RuntimeError("a failing step")
    assert schedules._batch_p2p is original
    with staged_p2p(False):
        assert schedules._batch_p2p is original
