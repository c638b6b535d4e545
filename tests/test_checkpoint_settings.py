"""The optimizer's settings (lr, betas, ...) round-trip, saved once when every parameter shares them.

Flattened, the settings are one DCP item per parameter and field (three in four of a small
GPT's checkpoint entries), which every save pickles, gathers and broadcasts in its
metadata. The lab's AdamW has one group, so a checkpoint stores them once
(``optim_settings.<field>``); an optimizer whose parameters differ keeps the per-parameter
form. Both load back into a fresh optimizer. One process, a gloo world of one.
"""
from __future__ import annotations

import pytest
import torch

from kernels.checkpoint.save_load import SHARED_SETTINGS, load_checkpoint, save_checkpoint, shared_settings
from kernels.checkpoint.files import CheckpointMissingError, tensor_shapes
from kernels.model.gpt import GPTConfig, build_gpt

CONFIG = GPTConfig(layers=1, d_model=16, heads=2, d_ff=32, vocab=32, seq_len=8)


def _trained(optimizer_for) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_gpt(CONFIG)
    optimizer = optimizer_for(model)
    tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len + 1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    return model, optimizer


def _two_groups(model: torch.nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    """Norms and biases without weight decay at another lr: settings that differ by parameter."""
    plain = [p for n, p in model.named_parameters() if p.ndim < 2]
    rest = [p for n, p in model.named_parameters() if p.ndim >= 2]
    return torch.optim.AdamW([{"params": rest}, {"params": plain, "weight_decay": 0.0, "lr": lr / 2}], lr=lr)


def test_shared_settings_are_saved_once_and_read_back(world_of_one, tmp_path):
    model, optimizer = _trained(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, betas=(0.8, 0.9)))
    save_checkpoint(str(tmp_path / "step_1"), model, optimizer, {"step": 1})
    stored = tensor_shapes(tmp_path / "step_1")
    assert not [k for k in stored if k.startswith("optim.param_groups.")]
    assert f"{SHARED_SETTINGS}.lr" in stored and f"{SHARED_SETTINGS}.betas" in stored

    fresh = build_gpt(GPTConfig(**{**CONFIG.__dict__, "seed": 1}))
    other = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # settings that the load must replace
    load_checkpoint(str(tmp_path / "step_1"), fresh, other)
    assert other.param_groups[0]["lr"] == 0.01 and tuple(other.param_groups[0]["betas"]) == (0.8, 0.9)
    for a, b in zip(optimizer.state.values(), other.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_settings_that_differ_by_parameter_are_saved_per_parameter(world_of_one, tmp_path):
    model, optimizer = _trained(_two_groups)
    save_checkpoint(str(tmp_path / "step_1"), model, optimizer, {"step": 1})
    stored = tensor_shapes(tmp_path / "step_1")
    assert not [k for k in stored if k.startswith(SHARED_SETTINGS)]
    assert "optim.param_groups.tok_emb.weight.lr" in stored

    fresh = build_gpt(CONFIG)
    other = _two_groups(fresh, lr=0.5)
    load_checkpoint(str(tmp_path / "step_1"), fresh, other)
    assert [g["lr"] for g in other.param_groups] == [0.01, 0.005]
    assert [g["weight_decay"] for g in other.param_groups] == [optimizer.param_groups[0]["weight_decay"], 0.0]


def test_a_setting_the_checkpoint_lacks_is_named(world_of_one, tmp_path):
    model, optimizer = _trained(lambda m: torch.optim.AdamW(m.parameters()))
    save_checkpoint(str(tmp_path / "step_1"), model, optimizer, {"step": 1})
    newer = torch.optim.AdamW(model.parameters())
    newer.param_groups[0]["future_knob"] = 1.0  # a field this checkpoint's optimizer did not have
    with pytest.raises(CheckpointMissingError, match="future_knob"):
        load_checkpoint(str(tmp_path / "step_1"), model, newer)


def test_shared_settings_are_none_when_any_field_differs():
    same = {"param_groups.a.lr": 0.1, "param_groups.b.c.lr": 0.1, "param_groups.a.betas": (0.9, 0.99)}
    assert shared_settings(same) == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert shared_settings({**same, "param_groups.b.c.lr": 0.2}) is None
    assert shared_settings({"param_groups.a.lr": torch.tensor(0.1)}) is None
    assert shared_settings({}) is None


def test_a_weights_only_checkpoint_is_refused_where_optimizer_state_is_needed_and_loads_for_plain_sgd(
        world_of_one, tmp_path):
    model, _ = _trained(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    save_checkpoint(str(tmp_path / "step_1"), model, None, {"step": 1})  # the weights alone
    fresh = build_gpt(GPTConfig(**{**CONFIG.__dict__, "seed": 1}))
    with pytest.raises(CheckpointMissingError, match="holds no optimizer state"):
        load_checkpoint(str(tmp_path / "step_1"), fresh, torch.optim.AdamW(fresh.parameters()))
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1)  # keeps no state: nothing to restore
    load_checkpoint(str(tmp_path / "step_1"), fresh, sgd, optimizer_settings=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert sgd.param_groups[0]["lr"] == 0.1
