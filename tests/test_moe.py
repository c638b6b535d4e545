"""The routed mixture of experts (kernels.model.moe): routing rules, capacity, the balance loss, and a naive twin.

One process, no ranks. The twin below is the teaching version: every token on its own, its experts
chosen by a Python sort, each expert's capacity counted assignment by assignment in priority order.
The packed MoE must equal it in output and gradients.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.contract.config_rules import ConfigError
from kernels.contract.run_config import RunConfig
from kernels.model.family import build_model, model_config, model_fields
from kernels.model.gpt import GPTConfig, build_gpt, loss_fn, param_seed
from kernels.model.llama import LlamaConfig
from kernels.model.moe import MoE
from kernels.train.reference import train_reference

TINY = dict(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
LLAMA = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=16)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _moe(experts: int = 4, top_k: int = 2, d: int = 8, hidden: int = 16, seed: int = 0, **options) -> MoE:
    moe = MoE(d, hidden, experts, top_k=top_k, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return moe


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _twin(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, aux loss) of ``moe`` computed token by token: the algorithm of kernels.model.moe, spelled out."""
    B, T, C = x.shape
    E, k = moe.num_experts, moe.top_k
    capacity = math.inf if moe.capacity_factor is None else math.ceil(moe.capacity_factor * T * k / E)
    out, aux = [[torch.zeros(C) for _ in range(T)] for _ in range(B)], 0.0
    for b in range(B):
        probs = [F.softmax(x[b, t] @ moe.router.weight.T, dim=-1) for t in range(T)]
        # Highest probability first; on a tie the lower expert index.
        picks = [sorted(range(E), key=lambda e, p=p.detach(): (-float(p[e]), e))[:k] for p in probs]
        taken = [0] * E
        for slot in range(k):  # every first choice before any second choice, then by position
            for t in range(T):
                e = picks[t][slot]
                taken[e] += 1
                if taken[e] > capacity:
                    continue  # dropped: the residual carries the token
                chosen = torch.stack([probs[t][i] for i in picks[t]])
                gate = chosen[slot] / chosen.sum() if k > 1 else chosen[slot]
                out[b][t] = out[b][t] + gate * moe.experts.expert(e, x[b, t:t + 1])[0]
        counts = torch.zeros(E)
        for t in range(T):
            for e in picks[t]:
                counts[e] += 1
        aux = aux + E * sum(counts[i] / (T * k) * torch.stack([p[i] for p in probs]).mean() for i in range(E))
    return torch.stack([torch.stack(row) for row in out]), aux / B


@pytest.mark.parametrize("gated, bias, capacity_factor", [(False, True, None), (True, False, None), (False, True, 0.75),
                                                         (True, True, 1.0)])
def test_the_packed_moe_equals_a_token_by_token_twin_in_output_and_gradients(gated, bias, capacity_factor):
    moe = _moe(experts=4, top_k=2, gated=gated, bias=bias, capacity_factor=capacity_factor, aux_loss_coef=0.3)
    x = _randn(2, 6, 8, seed=1).requires_grad_()
    weights = _randn(2, 6, 8, seed=2)
    (moe(x) * weights).sum().backward()
    packed = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    x.grad = None
    moe.zero_grad(set_to_none=True)
    twin_out, twin_aux = _twin(moe, x)
    ((twin_out * weights).sum() + 0.3 * twin_aux).backward()  # the aux gradient the MoE injects, added by hand
    torch.testing.assert_close(moe(x.detach()), twin_out.detach(), rtol=1e-5, atol=1e-6)
    assert moe.routing_stats()["aux_loss"] == pytest.approx(twin_aux.item(), rel=1e-5)
    for name, p in [("x", x), *moe.named_parameters()]:
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_dropless_routing_keeps_every_assignment():
    moe = _moe(experts=4, top_k=2)
    moe(_randn(3, 5, 8))
    stats = moe.routing_stats()
    assert stats["tokens"] == 15 and sum(stats["assigned_per_expert"]) == 15 * 2
    assert stats["kept_per_expert"] == stats["assigned_per_expert"] and stats["dropped"] == 0
    assert all(isinstance(n, int) for n in stats["assigned_per_expert"]) and isinstance(stats["aux_loss"], float)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_equal_probabilities_pick_the_lowest_expert_indices(top_k):
    moe = _moe(experts=4, top_k=top_k)
    torch.nn.init.zeros_(moe.router.weight)  # every token: probabilities 1/4 each
    x = _randn(2, 5, 8)
    moe(x)
    assert moe.routing_stats()["assigned_per_expert"] == [10 if e < top_k else 0 for e in range(4)]
    gate = 1 / top_k if top_k > 1 else 1 / 4  # renormalised over the k choices; Switch's raw probability for k=1
    expected = sum(gate * moe.experts.expert(e, x.reshape(10, 8)) for e in range(top_k)).reshape(2, 5, 8)
    torch.testing.assert_close(moe(x), expected)


def test_capacity_drops_second_choices_first_then_later_positions_per_sequence():
    # d_model = E = 3 and an identity router: each token's logits are its own row, so its choices are known.
    moe = _moe(experts=3, top_k=2, d=3, hidden=4, capacity_factor=0.75)  # ceil(0.75 * 4 * 2 / 3) = 2 per expert
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(3))
    tokens = torch.tensor([[2.0, 3.0, 0.0],  # t0 -> 1, then 0
                           [3.0, 0.0, 2.0],  # t1 -> 0, then 2
                           [0.0, 2.0, 3.0],  # t2 -> 2, then 1
                           [3.0, 2.0, 0.0]])  # t3 -> 0, then 1
    x = tokens.expand(2, 4, 3)  # two sequences: each has its own capacity
    y = moe(x)
    # Expert 0 queues t1 and t3 (first choices) before t0's second choice, which it drops though t0 comes first;
    # expert 1 queues t0 (first), then t2's and t3's second choices, and drops t3's.
    stats = moe.routing_stats()
    assert stats["assigned_per_expert"] == [6, 6, 4] and stats["kept_per_expert"] == [4, 4, 4]
    assert stats["dropped"] == 4
    probs = F.softmax(tokens, dim=-1)
    gates = {(t, e): probs[t, e] / (probs[t, first] + probs[t, second])
             for t, (first, second) in enumerate([(1, 0), (0, 2), (2, 1), (0, 1)]) for e in (first, second)}
    kept = [(0, 1), (1, 0), (1, 2), (2, 2), (2, 1), (3, 0)]  # (token, expert); t0->0 and t3->1 dropped
    expected = torch.zeros(4, 3)
    for t, e in kept:
        expected[t] += gates[t, e] * moe.experts.expert(e, tokens[t:t + 1])[0]
    torch.testing.assert_close(y, expected.expand(2, 4, 3))


def test_the_balance_loss_is_switchs_formula_per_sequence_and_reaches_the_router():
    moe = _moe(experts=4, top_k=2, aux_loss_coef=0.0)
    x = _randn(3, 7, 8)
    moe(x)
    probs = F.softmax(x @ moe.router.weight.T, dim=-1)  # (B, T, E)
    chosen = probs.sort(dim=-1, descending=True, stable=True).indices[..., :2]
    f = F.one_hot(chosen, 4).sum(dim=(1, 2)) / (7 * 2)  # (B, E)
    by_hand = (4 * (f * probs.mean(dim=1)).sum(dim=-1)).mean()
    assert moe.routing_stats()["aux_loss"] == pytest.approx(by_hand.item(), rel=1e-6)

    def router_grad(coef: float) -> torch.Tensor:
        """The router's gradient from the aux loss alone: the output takes no gradient (times 0)."""
        moe.aux_loss_coef = coef
        moe.zero_grad(set_to_none=True)
        (moe(x) * 0).sum().backward()
        return moe.router.weight.grad

    aux_grad = torch.autograd.grad(by_hand, moe.router.weight)[0]
    assert aux_grad.abs().max() > 1e-2
    torch.testing.assert_close(router_grad(0.5), 0.5 * aux_grad)
    assert not router_grad(0.0).any()


def test_the_aux_coefficient_changes_the_gradient_not_the_reported_loss():
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for coef in (0.0, 0.5):
        model = build_gpt(GPTConfig(**TINY, experts=4, top_k=2, aux_loss_coef=coef))
        loss = loss_fn(model(tokens), tokens)
        loss.backward()
        losses.append(loss.item())
        grads.append(model.blocks["0"].mlp.router.weight.grad)
    assert losses[0] == losses[1]
    assert not torch.allclose(grads[0], grads[1])


def test_no_experts_is_the_dense_model_unchanged():
    before, after = GPTConfig(**TINY), GPTConfig(**TINY, experts=0, top_k=3, capacity_factor=1.0, aux_loss_coef=0.5)
    dense, same = build_gpt(before), build_gpt(after)
    assert list(dict(dense.named_parameters())) == list(dict(same.named_parameters()))
    assert all(torch.equal(p, q) for p, q in zip(dense.parameters(), same.parameters()))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(dense(tokens), same(tokens))
    # The names and draws of the dense MLP are the seeded scheme's, as before experts existed.
    name = "blocks.1.mlp.fc_out.weight"
    g = torch.Generator().manual_seed(param_seed(0, name))
    assert torch.equal(dense.get_parameter(name), torch.empty(32, 128).normal_(0.0, 0.02 / math.sqrt(4), generator=g))
    # What a run records: a dense model's dict has no expert fields, for either family.
    assert list(model_fields(after)) == ["layers", "d_model", "heads", "vocab", "seq_len", "d_ff", "bias"]
    llama = model_fields(LlamaConfig(**LLAMA))
    assert "experts" not in llama and model_fields(LlamaConfig(**LLAMA, experts=4))["experts"] == 4


def test_expert_weights_are_packed_expert_first_and_seeded_by_name():
    model = build_gpt(GPTConfig(**TINY, experts=4))
    mlp = model.blocks["0"].mlp
    shapes = {n: tuple(p.shape) for n, p in mlp.named_parameters()}
    assert shapes == {"router.weight": (4, 32), "experts.w_in": (4, 32, 128), "experts.b_in": (4, 128),
                      "experts.w_out": (4, 128, 32), "experts.b_out": (4, 32)}
    g = torch.Generator().manual_seed(param_seed(0, "blocks.0.mlp.experts.w_out"))
    assert torch.equal(mlp.experts.w_out, torch.empty(4, 128, 32).normal_(0.0, 0.02 / math.sqrt(4), generator=g))
    assert mlp.router.weight.detach().std().item() == pytest.approx(0.02, rel=0.2)
    assert not mlp.experts.b_in.any() and not mlp.experts.b_out.any()
    llama = build_model(LlamaConfig(**LLAMA, experts=4)).blocks["0"].mlp
    assert {n: tuple(p.shape) for n, p in llama.experts.named_parameters()} == {
        "w_gate": (4, 32, 64), "w_up": (4, 32, 64), "w_down": (4, 64, 32)}


def test_a_moe_blocks_tp_plan_splits_the_attention_only_and_refuses_sequence_parallel():
    for cfg in (GPTConfig(**TINY, experts=4), LlamaConfig(**LLAMA, experts=4)):
        model = build_model(cfg)
        block_plan, _ = model.tp_plan()
        assert block_plan and all(name.split(".")[0] == "attn" for name in block_plan)  # attn and its projections
        assert "d_ff" not in model.tp_sizes() and "ffn" not in model.tp_sizes()
        with pytest.raises(ConfigError) as err:
            model.tp_plan(sequence_parallel=True)
        assert err.value.rules == ("moe-sp",)
    assert "mlp.fc_in" in build_model(GPTConfig(**TINY)).tp_plan()[0]


@pytest.mark.parametrize("model", [{**TINY, "experts": 4, "top_k": 2},
                                   {"family": "llama", **LLAMA, "experts": 4, "top_k": 1, "capacity_factor": 1.25}],
                         ids=["gpt-top2-dropless", "llama-switch-capacity"])
def test_a_model_with_experts_trains_in_one_process(model):
    result = train_reference(RunConfig(model=model, steps=6, global_batch=8, lr=1e-2))
    assert result["losses"][-1] < result["losses"][0] - 0.1, result["losses"]
    trained = build_model(model_config(RunConfig(model=model)))
    trained(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)))
    stats = trained.blocks["1"].mlp.routing_stats()
    assert sum(stats["assigned_per_expert"]) == 2 * 16 * model["top_k"]


@pytest.mark.parametrize("fields, rule, words", [
    ({"experts": 2, "top_k": 3}, "moe-top-k", ("top_k=3", "experts=2")),
    ({"experts": 4, "top_k": 0}, "moe-top-k", ("top_k",)),
    ({"experts": 4, "capacity_factor": 0}, "moe-capacity", ("capacity_factor",)),
    ({"experts": 4, "capacity_factor": "1.0"}, "moe-capacity", ("capacity_factor",)),
    ({"experts": 4, "capacity_factor": True}, "moe-capacity", ("capacity_factor",)),
    ({"experts": 2.0}, "moe-experts", ("experts",)),
    ({"experts": 4, "aux_loss_coef": -0.1}, "moe-aux-loss", ("aux_loss_coef",)),
])
def test_the_config_rules_refuse_odd_expert_fields_by_name(fields, rule, words):
    for make in (lambda: GPTConfig(**TINY, **fields), lambda: LlamaConfig(**LLAMA, **fields),
                 lambda: RunConfig(model={**TINY, **fields})):
        with pytest.raises(ConfigError) as err:
            make()
        assert err.value.rules == (rule,), str(err.value)
        assert all(word in str(err.value) for word in words), str(err.value)


def test_micro_batches_divide_the_aux_gradient_as_they_divide_the_loss():
    model = {**TINY, "experts": 4, "top_k": 2, "aux_loss_coef": 1.0}
    whole = train_reference(RunConfig(model=model, steps=2))
    split = train_reference(RunConfig.from_options({"model": model, "steps": 2, "microbatches": 4}))
    router = "blocks.0.mlp.router.weight"
    torch.testing.assert_close(split["params"][router], whole["params"][router], rtol=0, atol=1e-5)
