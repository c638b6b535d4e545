"""The GPT and the synthetic data: deterministic, shaped right, splittable, learnable."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from kernels.train.data import SORTED_SUCCESSORS_MAX_VOCAB, SyntheticTokens, microbatches, shard_batch
from kernels.contract.layout_rules import layer_split
from kernels.model.gpt import GPTConfig, build_gpt, count_parameters, loss_fn
from kernels.model.family import keep_stage

TINY = GPTConfig(layers=2, d_model=32, heads=2, vocab=32, seq_len=16, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_gpt_gives_the_same_weights_whatever_the_global_rng():
    torch.manual_seed(1)
    a = build_gpt(TINY)
    torch.manual_seed(2)
    b = build_gpt(TINY)
    assert _same_weights(a, b)


def test_build_gpt_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    build_gpt(TINY)
    assert torch.equal(before, torch.get_rng_state())


def test_different_seeds_give_different_weights():
    a = build_gpt(TINY)
    b = build_gpt(dataclasses.replace(TINY, seed=1))
    assert not torch.equal(a.blocks["0"].attn.q.weight, b.blocks["0"].attn.q.weight)


def test_residual_projections_are_scaled_like_gpt2():
    cfg = GPTConfig(layers=8, d_model=64, heads=4, vocab=512, seq_len=8)
    gpt = build_gpt(cfg)
    std_q = gpt.blocks["0"].attn.q.weight.std().item()
    std_out = gpt.blocks["0"].attn.out.weight.std().item()
    assert std_q == pytest.approx(0.02, rel=0.1)
    assert std_out == pytest.approx(0.02 / math.sqrt(2 * cfg.layers), rel=0.1)


def test_forward_maps_tokens_to_logits():
    gpt = build_gpt(TINY)
    tokens = torch.randint(0, TINY.vocab, (3, TINY.seq_len))
    assert gpt(tokens).shape == (3, TINY.seq_len, TINY.vocab)
    assert gpt(tokens[:, :5]).shape == (3, 5, TINY.vocab)  # shorter sequences are fine


def test_the_lm_head_is_not_tied_and_counts_its_own_parameters():
    cfg = TINY
    gpt = build_gpt(cfg)
    assert gpt.lm_head.weight.data_ptr() != gpt.tok_emb.weight.data_ptr()
    C, V, F, L = cfg.d_model, cfg.vocab, cfg.d_ff, cfg.layers
    block = 4 * (C * C + C) + (C * F + F) + (F * C + C) + 2 * 2 * C
    assert count_parameters(gpt) == V * C + cfg.seq_len * C + L * block + 2 * C + C * V


@pytest.mark.parametrize("bad", [dict(heads=3), dict(layers=0), dict(vocab=-1), dict(d_ff=0)])
def test_gpt_config_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        GPTConfig(**{**dict(layers=2, d_model=32, heads=2, vocab=32, seq_len=16), **bad})


@pytest.mark.parametrize("num_stages", [1, 2])
def test_pipeline_stages_chained_equal_the_whole_model(num_stages):
    full = build_gpt(TINY)
    tokens = torch.randint(0, TINY.vocab, (2, TINY.seq_len))
    x = tokens
    for s in range(num_stages):
        stage = keep_stage(build_gpt(TINY), s, num_stages)
        assert list(stage.blocks.keys()) == [str(i) for i in layer_split(TINY.layers, num_stages, s)]
        assert (stage.tok_emb is None) == (s > 0) and (stage.lm_head is None) == (s < num_stages - 1)
        x = stage(x)  # (B, T, C) between stages, (B, T, V) after the last
        assert x.shape[-1] == (TINY.vocab if s == num_stages - 1 else TINY.d_model)
    torch.testing.assert_close(x, full(tokens), rtol=0, atol=0)


def test_a_middle_stage_keeps_layer_names_and_weights():
    cfg = GPTConfig(layers=4, d_model=32, heads=2, vocab=32, seq_len=8)
    full, middle = build_gpt(cfg), keep_stage(build_gpt(cfg), 1, 4)
    sd = middle.state_dict()
    assert sd and all(k.startswith("blocks.1.") for k in sd)
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in sd.items())
    h = torch.randn(2, 8, cfg.d_model)
    assert middle(h).shape == h.shape


def test_attention_takes_its_head_count_from_the_projection_width():
    """A TP rank holds heads/tp heads: halve q/k/v column-wise and out row-wise by hand."""
    cfg = GPTConfig(layers=1, d_model=32, heads=4, vocab=32, seq_len=8)
    attn = build_gpt(cfg).blocks["0"].attn
    x = torch.randn(2, 8, cfg.d_model)
    halves = []
    for r in range(2):
        part = build_gpt(cfg).blocks["0"].attn
        with torch.no_grad():
            for name in ("q", "k", "v"):
                lin, full = getattr(part, name), getattr(attn, name)
                lin.weight = torch.nn.Parameter(full.weight.chunk(2, 0)[r].clone())
                lin.bias = torch.nn.Parameter(full.bias.chunk(2, 0)[r].clone())
            part.out.weight = torch.nn.Parameter(attn.out.weight.chunk(2, 1)[r].clone())
            part.out.bias = torch.nn.Parameter(attn.out.bias / 2)
        halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1], attn(x))


def test_loss_falls_on_synthetic_data():
    gpt = build_gpt(TINY)
    data = SyntheticTokens(TINY.vocab, TINY.seq_len, seed=0)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    losses = []
    for step in range(50):
        x, y = data.global_batch(step, 16)
        loss = loss_fn(gpt(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(TINY.vocab), rel=0.05)
    assert losses[-1] < 0.7 * losses[0]
    assert losses[-1] > data.loss_floor - 0.1


def test_global_batch_is_deterministic_in_seed_and_step():
    a = SyntheticTokens(32, 16, seed=0)
    x0, y0 = a.global_batch(3, 8)
    x1, y1 = SyntheticTokens(32, 16, seed=0).global_batch(3, 8)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert x0.shape == y0.shape == (8, 16) and x0.dtype == torch.long
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(a.global_batch(4, 8)[0], x0)
    assert not torch.equal(SyntheticTokens(32, 16, seed=1).global_batch(3, 8)[0], x0)


@pytest.mark.parametrize("dp_world", [1, 2, 4])
def test_shard_batch_matches_distributed_sampler_and_reassembles(dp_world):
    x, y = SyntheticTokens(32, 16, seed=0).global_batch(0, 8)
    shards = []
    for r in range(dp_world):
        xs, ys = shard_batch(x, y, r, dp_world)
        order = list(DistributedSampler(range(8), num_replicas=dp_world, rank=r, shuffle=False))
        assert torch.equal(xs, x[order]) and torch.equal(ys, y[order])
        shards.append((order, xs))
    whole = torch.empty_like(x)
    for order, xs in shards:
        whole[order] = xs
    assert torch.equal(whole, x)


def test_shard_batch_rejects_an_uneven_split():
    x, y = SyntheticTokens(32, 16).global_batch(0, 6)
    with pytest.raises(ValueError, match="divisible"):
        shard_batch(x, y, 0, 4)


def test_microbatches_are_contiguous_equal_chunks():
    x = torch.arange(12).view(6, 2)
    parts = microbatches(x, 3)
    assert [p.shape for p in parts] == [(2, 2)] * 3
    assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ValueError, match="divisible"):
        microbatches(x, 4)


def test_a_small_vocabulary_keeps_its_sorted_successors():
    # The data of every model up to SORTED_SUCCESSORS_MAX_VOCAB is what it always was: notebooks' figures hold.
    g = torch.Generator().manual_seed(3)
    sorted_way = torch.rand(256, 256, generator=g).argsort(dim=1)[:, :4]
    assert torch.equal(SyntheticTokens(256, 8, seed=3).successors, sorted_way)


def test_a_large_vocabulary_builds_without_a_vocab_squared_sort():
    # 32768 once sorted a 32768² matrix on every rank: minutes and 13 GB before the first step (seen on a GPU).
    vocab = SORTED_SUCCESSORS_MAX_VOCAB * 16
    data = SyntheticTokens(vocab, 16, seed=1)
    table = data.successors
    assert table.shape == (vocab, 4) and all(len(set(row)) == 4 for row in table.tolist())
    assert 0 <= int(table.min()) and int(table.max()) < vocab
    assert torch.equal(SyntheticTokens(vocab, 16, seed=1).successors, table)  # seeded
    assert not torch.equal(SyntheticTokens(vocab, 16, seed=2).successors, table)
    x, y = data.global_batch(0, 4)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(y.max()) < vocab
