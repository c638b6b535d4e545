"""``lab.ParameterServer`` with models the user brought: in sync mode the losses equal one process's, for an
HF Llama, a mixture-of-experts (whose workers may leave an expert without gradient) and a ``lab.Model``
trained on its own loss."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import lab  # noqa: E402
from tests.test_own_module import TokenMLP, smoothed  # noqa: E402

RUN = dict(global_batch=12, steps=3)  # 12: divisible by the 3 workers of one server


def _sync_matches(pool, model) -> None:
    ps = lab.ParameterServer(pool, model, servers=1, mode="sync", **RUN)
    result, reference = ps.run(timeout=120), ps.reference()
    assert result.matches(reference, rtol=1e-4), result.loss_table(reference)
    assert reference.losses[-1] < reference.losses[0]


@pytest.mark.slow  # the fast tier keeps the GPT's sync PS (tests/test_parameter_server.py)
def test_sync_ps_trains_an_hf_llama_as_one_process(cluster):
    _sync_matches(cluster, transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda: transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                       num_experts_per_tok=1),
    lambda: lab.Model(TokenMLP, loss=smoothed, seq_len=16),
], ids=["mixtral-8-experts", "module-own-loss"])
def test_sync_ps_trains_other_models_as_one_process(cluster, make):
    _sync_matches(cluster, make())
