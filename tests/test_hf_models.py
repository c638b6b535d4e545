"""Hugging Face causal LMs, built from tiny configs on every rank, on every layout family.

The same guarantee as the lab's own models: from the seed, the same weights on every rank and in
one process, and every layout's losses equal the one-process reference step by step. HF Llama
brings its own tensor-parallel plan (``base_model_tp_plan``) and pipeline plan; GPT-2 brings
neither, so the lab's own plan shards its fused q/k/v by heads. Nothing is downloaded.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lab  # noqa: E402
from kernels.contract.run_config import RunConfig  # noqa: E402
from kernels.model.family import build_model, keep_stage, model_config, model_fields  # noqa: E402
from lab.run.own_models import own_config  # noqa: E402

STEPS, GLOBAL_BATCH = 3, 8


def hf_llama(**changes):
    return transformers.LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2), **changes})


def gpt2(**changes):
    return transformers.GPT2Config(**{**dict(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=32), **changes})


def _parity(pool: lab.Cluster, model, layout: dict, **options) -> None:
    exp = lab.Experiment(pool, model, lab.Parallel(**layout), global_batch=GLOBAL_BATCH, steps=STEPS, lr=3e-3,
                         **options)
    result, reference = exp.run(progress=False), exp.reference()
    rtol = 2e-3 if layout.get("mixed_precision") == "bf16" else 1e-4
    assert result.losses == pytest.approx(reference.losses, rel=rtol), result.loss_table(reference)
    assert reference.losses[-1] < reference.losses[0]


@pytest.mark.parametrize("make", [hf_llama, gpt2], ids=["llama", "gpt2"])
def test_stages_chained_give_the_whole_models_logits(make):
    """Cut along the pipeline plan, each stage recomputes what sits beside the blocks (rotary, masks,
    positions): four stages chained equal the whole model, and keep the model's own names."""
    cfg = model_config(RunConfig(model=model_fields(own_config(make(tie_word_embeddings=False))), seed=1))
    whole = build_model(cfg)
    x = torch.randint(0, 64, (2, 16))
    h = x
    for stage in range(4):
        h = keep_stage(copy.deepcopy(whole), stage, 4)(h)
    torch.testing.assert_close(h, whole(x), rtol=0, atol=0)
    assert {n for n, _ in whole.named_parameters()} == {n for n, _ in whole.inner.named_parameters()}


@pytest.mark.slow  # 5 s; test_own_model_measure runs an HF Llama under TP and DP in the fast tier
def test_hf_llama_under_tp_and_dp_matches_one_process(cluster):
    _parity(cluster, hf_llama(num_hidden_layers=2), dict(dp=2, tp=2))


@pytest.mark.slow  # fast tier: TP x DP above
@pytest.mark.parametrize("layout", [
    dict(dp=4), dict(dp=4, zero=1), dict(dp=4, zero=2), dict(dp=4, zero=3), dict(dp=4, fsdp_strategy="hybrid"),
    dict(dp=2, tp=2, zero=3), dict(dp=2, tp=2, loss_parallel=True), dict(pp=2, dp=2, microbatches=2),
    dict(pp=2, tp=2, microbatches=2), dict(pp=2, dp=2, schedule="interleaved_1f1b", microbatches=4),
    dict(dp=4, zero=3, mixed_precision="bf16", activation_checkpointing=True),
    dict(dp=2, tp=2, sequence_parallel=True), dict(dp=2, tp=2, zero=3, sequence_parallel=True, loss_parallel=True,
                                                   activation_checkpointing=True),
    dict(pp=2, tp=2, sequence_parallel=True, microbatches=2),
], ids=["ddp4", "zero1", "zero2", "zero3", "hsdp-2x2", "tp2-fsdp2", "tp2-dp2-loss-parallel", "pp2-dp2-1f1b",
        "pp2-tp2-1f1b", "pp2-dp2-interleaved", "zero3-bf16-ac", "tp2-dp2-sp", "tp2-fsdp2-sp-lp-ac", "pp2-tp2-sp"])
def test_hf_llama_on_every_layout_family_matches_one_process(cluster, layout):
    _parity(cluster, hf_llama(), layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    dict(dp=4), dict(dp=4, zero=1), dict(dp=4, zero=2), dict(dp=4, zero=3), dict(dp=4, fsdp_strategy="hybrid"),
    dict(dp=2, tp=2), dict(tp=4), dict(pp=2, dp=2, microbatches=2),
    dict(pp=2, tp=2, microbatches=2), dict(pp=2, dp=2, zero=3, microbatches=2),
    dict(pp=2, dp=2, schedule="interleaved_1f1b", microbatches=4),
    dict(pp=2, dp=2, schedule="zbv", microbatches=4), dict(dp=2, tp=2, sequence_parallel=True),
    dict(pp=2, tp=2, sequence_parallel=True, microbatches=2),
    dict(dp=4, zero=3, mixed_precision="bf16", activation_checkpointing=True),
], ids=["ddp4", "zero1", "zero2", "zero3", "hsdp-2x2", "tp2-dp2", "tp4", "pp2-dp2", "pp2-tp2", "pp2-fsdp2",
        "pp2-dp2-interleaved", "pp2-dp2-zbv", "tp2-dp2-sp", "pp2-tp2-sp", "zero3-bf16-ac"])
def test_gpt2_with_the_labs_plan_matches_one_process(cluster, layout):
    """GPT-2 ties its head to the token embedding: a pipeline's first and last stage each hold a copy, kept
    equal by summing their gradients (kernels.parallel.tied_stages)."""
    _parity(cluster, gpt2(), layout)


@pytest.mark.slow
@pytest.mark.parametrize("make", [hf_llama, gpt2], ids=["llama", "gpt2"])
def test_3d_on_eight_ranks_matches_one_process(cluster8, make):
    _parity(cluster8, make(), dict(pp=2, dp=2, tp=2, microbatches=2))


@pytest.mark.slow  # two runs, an export and a resume: 15 s
@pytest.mark.parametrize("make, resume_layout", [
    (hf_llama, dict(pp=2, dp=2, microbatches=2)),
    pytest.param(gpt2, dict(dp=4, zero=3), marks=pytest.mark.slow),  # tied: save_pretrained stores the head once
], ids=["llama-to-pp2", "gpt2-to-zero3"])
def test_an_hf_export_loads_in_transformers_with_the_trained_logits_and_resumes_under_another_layout(
        cluster, tmp_path, make, resume_layout):
    """lab-trained HF model -> ``lab.export(format="hf")`` -> ``from_pretrained``: the same logits to 1e-5; the
    directory read back with ``resume_from`` into another layout goes on as one process does from it."""
    config = make()
    exp = lab.Experiment(cluster, config, lab.Parallel(dp=2, tp=2), global_batch=GLOBAL_BATCH, steps=2, lr=3e-3,
                         checkpoint_dir=str(tmp_path / "run"))
    trained = exp.run(progress=False, return_params=True).params[0]
    out = lab.export(lab.checkpoints(tmp_path / "run")[-1], tmp_path / "hf", format="hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    model = build_model(model_config(RunConfig.from_dict(exp.config())))
    model.load_state_dict({k: torch.tensor(v) for k, v in trained.items()}, strict=not model.spec["tied"])
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x), rtol=0, atol=1e-5)
    resumed = lab.Experiment(cluster, config, lab.Parallel(**resume_layout), global_batch=GLOBAL_BATCH,
                             steps=3, lr=3e-3, resume_from=out)
    result, reference = resumed.run(progress=False), resumed.reference()
    assert result.losses == pytest.approx(reference.losses, rel=1e-4), result.loss_table(reference)
    fresh = lab.Experiment(cluster, config, lab.Parallel(dp=4), global_batch=GLOBAL_BATCH, steps=1).reference()
    assert result.losses[0] < fresh.losses[0]  # it starts from the trained weights, not from the seed's


def test_format_hf_refuses_a_model_not_built_from_a_config(tmp_path):
    from lab.run.hf_export import write_hf_directory
    with pytest.raises(ValueError, match="format='hf'"):
        write_hf_directory({"layers": 2}, {}, tmp_path / "out")


@pytest.mark.slow
def test_a_live_hf_training_relayouts_and_goes_on_as_one_run(cluster):
    """lab.Training holds an HF Llama on the ranks: TP2×DP2 for two steps, resharded in place to PP2×DP2 for two
    more, equal to four uninterrupted DP4 steps."""
    config = hf_llama()
    whole = lab.Experiment(cluster, config, lab.Parallel(dp=4), global_batch=GLOBAL_BATCH, steps=4, lr=3e-3).run(
        progress=False)
    with lab.Training(cluster, config, lab.Parallel(dp=2, tp=2), global_batch=GLOBAL_BATCH, lr=3e-3) as training:
        training.step(2)
        training.relayout(lab.Parallel(pp=2, dp=2, microbatches=2))
        training.step(2)
        assert training.losses == pytest.approx(whole.losses, rel=1e-4)


@pytest.mark.slow
def test_qwen3s_head_norms_replicated_with_their_gradient_summed_match_one_process(cluster):
    """Qwen3 normalises each head's q and k (``replicated_with_grad_allreduce``): under TP each rank normalises its
    heads with the whole weight, whose gradient is summed over every rank's heads."""
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert "replicated_with_grad_allreduce" in own_config(config).spec["tp_plan"].values()
    _parity(cluster, config, dict(dp=2, tp=2))
    _parity(cluster, config, dict(dp=2, tp=2, sequence_parallel=True))
