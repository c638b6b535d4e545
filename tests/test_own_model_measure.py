"""``measure=True`` on models the user brought: memory by category equal to the sharding rule, activations
split by the module type that saved them, and every collective beside the planner's volume where the
planner sizes the model (HF Llama, GPT-2), measured only where it does not (a ``lab.Model``)."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import lab  # noqa: E402
from tests.test_own_module import PLAN, TokenMLP  # noqa: E402

MODEL_STATES = ("params", "grads", "optimizer")


def _measured(pool, model, layout: dict) -> lab.RunResult:
    return lab.Experiment(pool, model, lab.Parallel(**layout), global_batch=8, steps=2, measure=True).run(progress=False)


def _check_memory(result) -> dict[str, int]:
    """Every rank's model states equal the rule; the activation parts sum to the activations. Rank 0's parts."""
    parts0 = {}
    for row in result.memory_records:
        if row["category"] in MODEL_STATES:
            assert row["measured"] == row["predicted"], row
        if row["category"] == "activations":
            parts = {r["category"][len("activations."):]: r["measured"] for r in result.memory_records
                     if r["rank"] == row["rank"] and r["moment"] == row["moment"]
                     and r["category"].startswith("activations.")}
            assert sum(parts.values()) == row["measured"] > 0
            assert row["predicted"] is None and "measured only" in row["predicted_source"]
            parts0 = parts if row["rank"] == 0 else parts0
    return parts0


def _check_comm(result, predicted_axes: bool) -> set[str]:
    """Each collective's measured payload equals its prediction; tp and pp rows predicted only where asked."""
    sources = set()
    for row in result.comm_records:
        sources.add(row["source"])
        if row["source"] in ("funcol", "pipeline") and not predicted_axes:
            assert row["predicted_payload_bytes"] is None, row
            continue
        assert row["payload_bytes"] == row["predicted_payload_bytes"], row
    return sources


def hf_llama():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def test_an_hf_llama_under_tp_and_dp_is_measured_beside_its_predictions(cluster):
    """TP2×DP2 runs FSDP2 replicating only, so each rank holds whole states of its TP shard; the planner counts
    a gated MLP's separate gate and up projections and the split embedding and head."""
    result = _measured(cluster, hf_llama(), dict(dp=2, tp=2))
    assert {"attention", "mlp", "norms", "embeddings", "projection", "cross-entropy"} <= set(_check_memory(result))
    assert {"funcol", "dist"} <= _check_comm(result, predicted_axes=True)


@pytest.mark.slow
@pytest.mark.parametrize("make, layout, predicted_axes", [
    (lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32),
     dict(pp=2, dp=2, microbatches=2), True),
    (lambda: lab.Model(TokenMLP, tp_plan=PLAN, blocks="layers", seq_len=16), dict(dp=2, tp=2), False),
    (lambda: lab.Model(TokenMLP, tp_plan=PLAN, blocks="layers", seq_len=16), dict(dp=4, zero=3), False),
    (hf_llama, dict(pp=2, tp=2, microbatches=2), True),
    # Sequence parallelism on a model the user brought cuts the stream only between its blocks.
    (hf_llama, dict(pp=2, tp=2, microbatches=2, sequence_parallel=True, activation_checkpointing=True), True),
    (lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32),
     dict(dp=2, tp=2, sequence_parallel=True), True),
], ids=["gpt2-pp2-dp2-tied", "module-tp2-dp2", "module-zero3", "llama-pp2-tp2", "llama-pp2-tp2-sp-recompute",
        "gpt2-tp2-dp2-sp"])
def test_other_models_and_layouts_are_measured_beside_their_predictions(cluster, make, layout, predicted_axes):
    result = _measured(cluster, make(), layout)
    if layout.get("pp", 1) == 1:
        _check_memory(result)
    _check_comm(result, predicted_axes)
