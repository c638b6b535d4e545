"""``lab.plan(model=<a config>)``: the planner reads a lab.Llama's or a Hugging Face config's own shape.

The shape-derived parameter count must equal the model's when built (on the meta device), and a plan
from the config must equal the plan from the same shape given by hand.
"""
from __future__ import annotations

import pytest
import torch

import lab
from kernels.model.llama import build_llama
from lab.planning.plan_own_models import spec_from_config

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(**TINY), transformers.MistralConfig(**TINY), transformers.Qwen2Config(**TINY),
    transformers.LlamaConfig(**{**TINY, "tie_word_embeddings": True}),
    transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32),
], ids=["llama", "mistral", "qwen2", "llama-tied", "gpt2"])
def test_the_count_read_from_a_config_is_the_built_models(config):
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    assert spec_from_config(config).params == sum(p.numel() for p in built.parameters())


def test_a_lab_llamas_count_is_its_own():
    llama = lab.Llama(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
    assert spec_from_config(llama).params == sum(p.numel() for p in build_llama(llama).parameters())


def test_a_plan_from_a_config_equals_the_plan_from_its_shape_by_hand():
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    by_hand = dict(name="by hand", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                   gated_mlp=True, tied_embeddings=False, learned_pos=False, bias=False, one_tp_input=False,
                   sharded_ends=True)
    ours, theirs = (lab.plan(m, gpus=16, parallel=dict(tp=8, dp=2), seq_len=4096, global_batch=64)
                    for m in (config, by_hand))
    assert ours.params == theirs.params == pytest.approx(8.03e9, rel=1e-3)
    assert ours.memory == theirs.memory and ours.comm == theirs.comm
