"""``lab.plan(..., measure_on=cluster)``: a scaled-down copy of the planned model runs on the pool under the
planned layout, and the planner's prediction for that copy sits beside what it measured.

Every tensor- and pipeline-parallel collective of the copy moves the bytes the planner predicts, exactly, and so
do the parameters and gradients of every stage (``lab.planning.plan_shape_params``: what TP replicates stays
whole, the ends sit on the first and last stages). The optimizer state and the data-parallel traffic are within
2%: the optimizer state measured holds AdamW's 4-byte step per tensor on top, and ZeRO-1's broadcast is named."""
from __future__ import annotations

import pytest

import lab
from lab.planning.plan_check import PlanCheck


def _transformers():
    return pytest.importorskip("transformers")


def _assert_as_planned(check: PlanCheck) -> None:
    table = "\n".join(map(str, check.table_rows()))
    traffic = [r for r in check.rows if r.what.startswith(("rank 0 funcol", "rank 0 pipeline"))]
    states = [r for r in check.rows if r.what.endswith(("params", "grads", "optimizer")) or " dist " in r.what]
    assert states, table
    assert all(r.ratio == pytest.approx(1.0, abs=1e-9) for r in traffic), table
    exact = [r for r in check.rows if r.what.endswith(("params", "grads"))]
    assert all(r.ratio == pytest.approx(1.0, abs=1e-9) for r in exact), table
    assert all(r.ratio == pytest.approx(1.0, abs=0.02) for r in states), table
    assert check.worst() < 0.02, table


def test_a_llama_8b_plan_measured_on_the_pool_matches_its_scaled_copy(cluster):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    planned = lab.plan(config, gpus=64, parallel=dict(tp=2, pp=2), global_batch=512, measure_on=cluster)
    check = planned.measured
    assert planned.params == pytest.approx(8.03e9, rel=1e-3)  # the plan is the real model's
    assert check.world == 4 and "TP2" in check.layout and "PP2" in check.layout
    kinds = {r.what for r in check.rows}
    assert {f"pp rank {r} {c}" for r in (0, 1) for c in ("params", "grads", "optimizer")} <= kinds, kinds
    assert {"rank 0 funcol all_reduce", "rank 0 pipeline send"} <= kinds, kinds
    _assert_as_planned(check)
    assert "measured on 4 ranks" in str(planned)


@pytest.mark.slow
@pytest.mark.parametrize("model, parallel", [
    (lambda: lab.GPT(layers=12, d_model=768, heads=12, vocab=50257, seq_len=1024), dict(zero=3)),
    ("llama3-8b", dict(tp=4)),
    (lambda: lab.Llama(layers=8, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1024), dict(tp=2, zero=0)),
    (lambda: _transformers().GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
     dict(tp=2, pp=2)),  # the lab's plan leaves GPT-2's embeddings and head whole on every tp rank
], ids=["gpt-zero3", "preset-tp4", "lab-llama-tp2", "gpt2-tp2-pp2"])
def test_other_models_and_layouts_measure_beside_their_plans(cluster, model, parallel):
    planned = lab.plan(model() if callable(model) else model, gpus=32, parallel=parallel, global_batch=64,
                       measure_on=cluster)
    _assert_as_planned(planned.measured)


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda t: t.GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12),  # a tied head: a copy on the last
    lambda t: t.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
], ids=["gpt2", "llama-3.2-1b-tied"])
def test_a_pipeline_gives_the_embeddings_to_its_first_stage_and_the_head_to_its_last(cluster, make):
    """Every stage's parameters and gradients are exact: the ends are not spread over the blocks."""
    transformers = pytest.importorskip("transformers")
    check = lab.plan(make(transformers), gpus=16, parallel=dict(pp=4), global_batch=64, measure_on=cluster).measured
    assert len([r for r in check.rows if r.what.endswith(("params", "grads"))]) == 8
    _assert_as_planned(check)


def test_a_layout_the_pool_cannot_hold_is_refused_before_anything_runs(cluster):
    with pytest.raises(lab.ParallelConfigError) as info:
        lab.plan("llama3-8b", gpus=64, parallel=dict(tp=8), global_batch=64, measure_on=cluster)
    assert [rule for rule, _ in info.value.problems] == ["measure-on-size"]
    assert lab.plan("llama3-8b", gpus=64, parallel=dict(tp=8), global_batch=64).measured is None
