"""What the lab shows of a run works unchanged on a model the user brought: the traced pipeline step and its
bubble, the sharding view under the model's own parameter names, the dashboard replayed from progress,
the memory view, and a hang report naming the hung rank."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import lab  # noqa: E402

T_FORWARD, TOLERANCE = 0.08, 0.03  # as tests/test_run_measurements.py: synthetic action costs, ±3 points


def hf_llama():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
def test_a_traced_hf_pipeline_shows_its_bubble_its_shards_and_its_progress(cluster):
    exp = lab.Experiment(cluster, hf_llama(), lab.Parallel(pp=2, dp=2, microbatches=4), global_batch=8, steps=2,
                         trace=True, synthetic_forward_s=T_FORWARD, measure=True)
    res = exp.run()
    assert res.matches(exp.reference(), rtol=1e-4)
    assert res.bubble["theory"] == pytest.approx(1 / 5) and abs(res.bubble["mean"] - res.bubble["theory"]) <= TOLERANCE
    assert {e["rank"] for e in res.events} == {0, 1, 2, 3}
    assert res.timeline() is not None and res.plot_timeline() is not None
    names = {name for record in res.layout for name in record["params"]}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"} <= names
    assert res.sharding() is not None and res.dashboard() is not None and res.memory() is not None


@pytest.mark.slow
def test_a_hung_rank_of_an_hf_model_is_named_in_the_hang_report(cluster):
    exp = lab.Experiment(cluster, hf_llama(), lab.Parallel(dp=4), global_batch=8, steps=3,
                         faults=[lab.Hang(2, at_step=1)], hang_after=3.0)
    with pytest.raises(lab.HangError) as info:
        exp.run()
    report = info.value.report
    assert report.never_arrived == (2,) and info.value.rank == 2
    assert "rank 2 never entered it" in report.findings[0]
    assert len(lab.Experiment(cluster, hf_llama(), lab.Parallel(dp=4), global_batch=8, steps=1).run().losses) == 1
