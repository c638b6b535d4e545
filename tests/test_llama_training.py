"""lab.Llama (Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head) on every layout family.

The same guarantee as the GPT's: from the seed, the same weights on every rank and in one
process, and every layout's losses equal the one-process reference step by step. Grouped-query
attention adds one size tensor parallelism splits (kv_heads), refused by name when it does not
divide; RoPE needs no position table, so a pipeline stage needs nothing of the first stage's.
"""
from __future__ import annotations

import pytest
import torch

import lab
from kernels.contract.run_config import RunConfig
from kernels.model.family import build_model, keep_stage, model_config, model_fields

LLAMA = dict(layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=16)
STEPS, GLOBAL_BATCH = 3, 8


def _parity(pool: lab.Cluster, layout: dict, **options) -> None:
    exp = lab.Experiment(pool, lab.Llama(**LLAMA), lab.Parallel(**layout), global_batch=GLOBAL_BATCH, steps=STEPS,
                         **options)
    result, reference = exp.run(progress=False), exp.reference()
    rtol = 2e-3 if layout.get("mixed_precision") == "bf16" else 1e-4
    assert result.losses == pytest.approx(reference.losses, rel=rtol), result.loss_table(reference)
    assert reference.losses[-1] < reference.losses[0]


def test_the_seed_fixes_the_weights_and_the_stages_keep_their_names():
    cfg = model_config(RunConfig(model=model_fields(lab.Llama(**LLAMA)), seed=3))
    whole, again = build_model(cfg), build_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), again.state_dict().values()))
    names = set(whole.state_dict())
    stages = [set(keep_stage(build_model(cfg), s, 2).state_dict()) for s in range(2)]
    assert stages[0] | stages[1] == names and not stages[0] & stages[1]
    assert "tok_emb.weight" in stages[0] and "lm_head.weight" in stages[1] and "blocks.3.attn.k.weight" in stages[1]
    assert whole.blocks["0"].attn.k.weight.shape == (2 * 8, 32)  # kv_heads x head_dim rows: grouped-query attention


def test_tp_and_dp_with_sequence_and_loss_parallel_match_one_process(cluster):
    _parity(cluster, dict(dp=2, tp=2, sequence_parallel=True, loss_parallel=True))


@pytest.mark.slow  # fast tier: TP x DP above; these are the other layout families
@pytest.mark.parametrize("layout", [
    dict(dp=4), dict(dp=4, zero=1), dict(dp=4, zero=2), dict(dp=4, zero=3), dict(dp=4, fsdp_strategy="hybrid"),
    dict(dp=2, tp=2, zero=3), dict(pp=2, dp=2, microbatches=2), dict(pp=2, tp=2, microbatches=2),
    dict(pp=2, dp=2, schedule="interleaved_1f1b", microbatches=4),
    dict(dp=4, zero=3, mixed_precision="bf16", activation_checkpointing=True),
], ids=["ddp4", "zero1-dp4", "zero2-dp4", "zero3-dp4", "hsdp-2x2", "tp2-fsdp2-zero3", "pp2-dp2-1f1b", "pp2-tp2-1f1b",
        "pp2-dp2-interleaved", "zero3-bf16-ac"])
def test_every_layout_family_matches_one_process(cluster, layout):
    _parity(cluster, layout)


@pytest.mark.slow
def test_3d_on_eight_ranks_matches_one_process(cluster8):
    _parity(cluster8, dict(pp=2, dp=2, tp=2, microbatches=2))


@pytest.mark.slow
def test_text_through_a_llama_resumes_under_another_layout(cluster, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog; the dog sleeps on. " * 20)
    model = lab.Llama(**{**LLAMA, "vocab": 128})
    lab.Experiment(cluster, model, lab.Parallel(dp=4, zero=3), global_batch=8, steps=2, data=str(corpus),
                   checkpoint_dir=str(tmp_path / "ckpt")).run(progress=False)
    resumed = lab.Experiment(cluster, model, lab.Parallel(pp=2, tp=2, microbatches=2), global_batch=8, steps=4,
                             data=str(corpus), resume_from=str(tmp_path / "ckpt"))
    result = resumed.run(progress=False)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), global_batch=8, steps=4, data=str(corpus)).reference()
    assert result.first_step == 2 and result.losses == pytest.approx(whole.losses[2:], rel=1e-4)
