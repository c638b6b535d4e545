"""``lab.Model``: any ``nn.Module`` from a picklable factory, on the layouts its plan allows, and the
rules that refuse what it cannot take, each before launch.

The module here is not a transformer: a token embedding, a stack of residual MLP blocks, a norm
and a head. DP, ZeRO and FSDP need nothing from it; TP needs its ``tp_plan``, PP its ``blocks``.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lab
from kernels.contract.run_config import RunConfig
from kernels.model.family import build_model, model_config, model_fields
from kernels.train.data import dataset
from kernels.train.reference import train_reference
from lab.run.own_models import own_config

STEPS, GLOBAL_BATCH, VOCAB = 3, 8, 64


class ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(x)))


class TokenMLP(nn.Module):
    """Each position's next token from its own token only: an MLP, no attention."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


PLAN = {"layers.*.fc_in": "colwise", "layers.*.fc_out": "rowwise"}


def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), label_smoothing=0.1)


def _experiment(pool, layout: dict, model=None, **options) -> lab.Experiment:
    model = model or lab.Model(TokenMLP, tp_plan=PLAN, blocks="layers", seq_len=16)
    return lab.Experiment(pool, model, lab.Parallel(**layout), global_batch=GLOBAL_BATCH, steps=STEPS, lr=3e-3,
                          **options)


def _parity(pool, layout: dict, model=None) -> None:
    exp = _experiment(pool, layout, model)
    result, reference = exp.run(progress=False), exp.reference()
    rtol = 2e-3 if layout.get("mixed_precision") == "bf16" else 1e-4
    assert result.losses == pytest.approx(reference.losses, rel=rtol), result.loss_table(reference)
    assert reference.losses[-1] < reference.losses[0]


def test_the_models_own_loss_is_the_one_trained_and_the_seed_fixes_the_weights():
    run = RunConfig(model=model_fields(own_config(lab.Model(TokenMLP, loss=smoothed, seq_len=16))), global_batch=4,
                    steps=1, seed=5)
    first = train_reference(run)["losses"][0]
    with torch.random.fork_rng():
        torch.manual_seed(5)
        built = TokenMLP()
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(),
                                                 build_model(model_config(run)).state_dict().values()))
    x, y = dataset(run).global_batch(0, 4)
    assert first == pytest.approx(float(smoothed(built(x), y)), rel=1e-6)
    assert first != pytest.approx(float(F.cross_entropy(built(x).flatten(0, 1), y.flatten(0, 1))), rel=1e-3)


def test_a_module_under_tp_and_pp_matches_one_process(cluster):
    _parity(cluster, dict(pp=2, tp=2, microbatches=2))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(dp=4), dict(dp=4, zero=1), dict(dp=4, zero=2), dict(dp=4, zero=3),
                                    dict(dp=4, fsdp_strategy="hybrid"),
                                    dict(dp=4, zero=3, mixed_precision="bf16", activation_checkpointing=True),
                                    dict(dp=2, tp=2), dict(pp=2, dp=2, microbatches=2),
                                    dict(pp=2, dp=2, schedule="interleaved_1f1b", microbatches=4),
                                    dict(dp=2, tp=2, sequence_parallel=True),
                                    dict(pp=2, tp=2, sequence_parallel=True, microbatches=2)],
                         ids=["ddp4", "zero1", "zero2", "zero3", "hsdp", "zero3-bf16-ac", "tp2-dp2", "pp2-dp2",
                              "pp2-dp2-interleaved", "tp2-dp2-sp", "pp2-tp2-sp"])
def test_a_module_on_every_layout_family_matches_one_process(cluster, layout):
    _parity(cluster, layout)


@pytest.mark.slow
def test_a_module_in_3d_on_eight_ranks_matches_one_process(cluster8):
    _parity(cluster8, dict(pp=2, dp=2, tp=2, microbatches=2))


def _refused(pool, layout: dict, model, **options) -> list[str]:
    with pytest.raises(lab.ParallelConfigError) as info:
        _experiment(pool, layout, model, **options)
    return [rule for rule, _ in info.value.problems]


def test_each_model_a_layout_cannot_take_is_refused_by_name_before_launch(cluster):
    transformers = pytest.importorskip("transformers")
    six_heads = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=6)
    assert "tp-heads" in _refused(cluster, dict(dp=1, tp=4), six_heads)
    assert _refused(cluster, dict(dp=2, tp=2), lab.Model(TokenMLP, seq_len=16)) == ["tp-plan"]
    assert _refused(cluster, dict(dp=2, pp=2), lab.Model(TokenMLP, tp_plan=PLAN, seq_len=16)) == ["pp-blocks"]
    assert _refused(cluster, dict(dp=2, pp=2), lab.Model(TokenMLP, blocks="norm", seq_len=16)) == ["pp-blocks"]
    lock = threading.Lock()
    assert _refused(cluster, dict(dp=4), lab.Model(lambda: lock and TokenMLP(), seq_len=16)) == ["model-pickle"]
    assert _refused(cluster, dict(dp=4), lab.Model(TokenMLP, tp_plan={"layers.*.nope": "colwise"})) == ["tp-plan"]
    assert _refused(cluster, dict(dp=2, tp=2), lab.Model(TokenMLP, tp_plan={"layers.*.fc_in": "packed_colwise"},
                                                         seq_len=16)) == ["tp-style"]
    assert _refused(cluster, dict(dp=4), lab.Model(TokenMLP, seq_len=16), data=lab.Text("/no/such/file.txt")) \
        == ["data-file"]
