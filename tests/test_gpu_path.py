"""The GPU path on real GPUs (``pytest -m gpu``): one NCCL rank, shared-GPU gloo ranks, bf16, compile, memory.

Every test here needs CUDA and skips, saying why, where there is none. Their CPU-side
logic is guarded in CI elsewhere: the world of one rank (``test_world_of_one``), the
rank choice for 0/1/2/8 GPUs (``test_rank_choice``), bf16 on every layout
(``test_mixed_precision``, ``test_layout_parity``), staged pipeline p2p
(``test_p2p_staging``) and compiled blocks (``test_compile``).

Against the one-process reference (which runs on the CPU in fp32 or emulated bf16) a GPU
run differs by TF32 matmuls and CUDA's own kernels, so losses are held to bf16-sized
bounds, not the exact CPU ones.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import lab

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here: these tests run NCCL and shared-GPU ranks on real GPUs")]

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
GPU_RTOL = 5e-3  # TF32 / bf16 kernels on the GPU against the CPU reference


@pytest.fixture(scope="module")
def one_gpu_rank():
    with lab.start(n=1, activate=False) as pool:
        yield pool


def test_one_rank_demo_checks_every_collective(one_gpu_rank):
    from lab.demo import check_collectives

    assert one_gpu_rank.backend == "nccl" and one_gpu_rank.rank_map.ranks[0].device == "cuda:0"
    rows = check_collectives(one_gpu_rank)
    assert rows and all(row["ok"] for row in rows), rows


@pytest.mark.parametrize("options", [dict(), dict(mixed_precision="bf16"), dict(zero=1), dict(zero=3),
                                     dict(zero=3, mixed_precision="bf16"), dict(activation_checkpointing=True),
                                     dict(microbatches=2)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_world_one_layouts_train_like_one_process_on_a_gpu(one_gpu_rank, options):
    exp = lab.Experiment(one_gpu_rank, TINY, lab.Parallel(**options), global_batch=8, steps=3)
    result, ref = exp.run(), exp.reference()
    assert result.matches(ref, rtol=GPU_RTOL), result.loss_table(ref)


def test_compiled_blocks_train_like_one_process_on_a_gpu(one_gpu_rank):
    exp = lab.Experiment(one_gpu_rank, TINY, lab.Parallel(mixed_precision="bf16"), global_batch=8, steps=3,
                         compile=True)
    result, ref = exp.run(), exp.reference()
    assert result.matches(ref, rtol=GPU_RTOL), result.loss_table(ref)


def test_measured_memory_at_rest_is_what_the_allocator_holds(one_gpu_rank):
    exp = lab.Experiment(one_gpu_rank, TINY, lab.Parallel(), global_batch=8, steps=2, measure=True)
    rows = {r["category"]: r["measured"] for r in exp.run().memory_records if r["moment"] == "at_rest"}
    counted = rows["params"] + rows["grads"] + rows["optimizer"]
    # At rest the model states are nearly all that is alive beside cuBLAS's workspaces: the allocator
    # rounds each tensor up to 512 bytes, and the step's batch, loss and norm scalars are a few KiB.
    assert counted <= rows["cuda_allocated"] - rows["cuda_workspaces"] <= counted + 2**20, rows
    assert rows["cuda_max_allocated"] >= rows["cuda_allocated"]


@pytest.fixture(scope="module")
def shared_gpu_ranks():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lab.start(n=4, share_gpu=True, activate=False) as pool:
            yield pool


@pytest.mark.parametrize("parallel", [dict(dp=4), dict(dp=4, zero=3), dict(tp=4), dict(dp=2, tp=2, zero=3),
                                      dict(pp=2, dp=2, microbatches=2), dict(pp=4, microbatches=4)],
                         ids=["ddp", "fsdp", "tp", "fsdp-tp", "pp-dp", "pp4"])
def test_four_ranks_on_one_gpu_train_like_one_process(shared_gpu_ranks, parallel):
    assert shared_gpu_ranks.backend == "gloo"
    assert all(r.device.startswith("cuda") for r in shared_gpu_ranks.rank_map.ranks)
    model = lab.GPT(layers=4, d_model=32, heads=4, vocab=64, seq_len=16)
    exp = lab.Experiment(shared_gpu_ranks, model, lab.Parallel(**parallel), global_batch=8, steps=3)
    result, ref = exp.run(), exp.reference()
    assert result.matches(ref, rtol=GPU_RTOL), result.loss_table(ref)
