"""Activations split by the part of the model that saved them, measured in one process on the tiny GPT.

The expected bytes are what each part's ops save for backward in fp32 on CPU, worked out by hand
(b = batch, s = seq_len, h = d_model, f = d_ff, a = heads, V = vocab, L = layers):

- attention: the normed input (saved by q, k and v: one storage), q, k, v, the SDPA output (the flash
  kernel on CPU: no s x s matrix, so the out projection's input is a view of it) = 5·b·s·h floats, plus
  the (b, a, s) logsumexp;
- MLP: its input, fc_in's output (GELU's input) and GELU's output = b·s·h + 2·b·s·f floats;
- norms: each LayerNorm's input plus its fp32 mean and rstd = (2L + 1)·(b·s·h + 2·b·s) floats;
- projection: lm_head's input = b·s·h floats;
- embeddings: the token ids and the positions, int64 = 8·b·s + 8·s bytes;
- cross-entropy: the log-softmax of the logits = b·s·V floats, the int64 targets (8·b·s bytes) and one fp32 scalar.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kernels.measure.activation_parts import PARTS, PartTracker, part_of
from kernels.contract.activation_rules import SOURCE, predicted_parts
from kernels.measure.memory import SavedActivations
from kernels.model.gpt import GPTConfig, build_gpt, loss_fn
from lab.measure.memory_and_comm import memory_records
from tests.test_widgets_timeline import mem_records, memory_rank_record
from widgets.memory_view import _memory_state

B, S, H, F, A, V, L = 8, 16, 32, 64, 4, 64, 2


def test_each_part_saves_what_its_ops_keep_for_backward():
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(layers=L, d_model=H, heads=A, vocab=V, seq_len=S, d_ff=F))
    tokens = torch.randint(0, V, (B, S + 1))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()  # two tensors, as the training data gives
    with SavedActivations(model) as acts:
        loss = loss_fn(model(inputs), targets)
    expected = {"attention": L * (4 * 5 * B * S * H + 4 * B * A * S), "mlp": L * 4 * (B * S * H + 2 * B * S * F),
                "norms": (2 * L + 1) * 4 * (B * S * H + 2 * B * S), "projection": 4 * B * S * H,
                "embeddings": 8 * B * S + 8 * S, "cross-entropy": 4 * B * S * V + 8 * B * S + 4}
    assert acts.parts == expected
    assert predicted_parts(B, S, H, A, F, V, L) == expected  # the rule the driver puts beside each measured part
    assert sum(acts.parts.values()) == acts.bytes
    loss.backward()  # the hooks are gone: a second forward outside the context counts nothing
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_parts_are_named_by_module_kind_and_a_wrapped_class_keeps_its_part():
    model = build_gpt(GPTConfig(layers=1, d_model=8, heads=2, vocab=16, seq_len=4, d_ff=16))
    named = {name: part_of(name, m) for name, m in model.named_modules()}
    assert named["blocks.0.attn"] == "attention" and named["blocks.0.mlp"] == "mlp"
    assert named["blocks.0.attn_norm"] == named["norm"] == "norms" and named["lm_head"] == "projection"
    assert named["tok_emb"] == "embeddings" and named[""] is None and named["blocks.0"] is None
    wrapped = type("FSDPCausalSelfAttention", (nn.Module,), {})()  # FSDP2 renames the class it wraps
    assert part_of("blocks.0.attn", wrapped) == "attention"
    assert set(named.values()) - {None} <= set(PARTS)
    with PartTracker(model) as tracker:
        assert tracker.current() == "cross-entropy"  # nothing of the model is running: the loss


def test_the_memory_view_shows_parts_as_a_table_not_as_more_bars():
    records = mem_records()  # lab.measure.memory_and_comm.memory_records of snapshots holding activation_parts
    plain = _memory_state([r for r in records if not r["category"].startswith("activations.")])
    state = _memory_state(records)
    for rank, bar in enumerate(state["bars"]["peak_fwd_bwd"]):
        parts = {p: v["measured"] for p, v in bar["activation_parts"].items()}
        assert parts == {"attention": 9_000, "mlp": 7_000, "norms": 3_000, "projection": 600,
                         "cross-entropy": 400 + rank}
        assert sum(parts.values()) == bar["measured"]["activations"]
        assert bar["measured"] == plain["bars"]["peak_fwd_bwd"][rank]["measured"]  # no bytes counted twice
        assert all("saved-tensor hooks" in v["source"] for v in bar["activation_parts"].values())
    assert all(bar["activation_parts"] == {} for bar in state["bars"]["at_rest"])


def test_each_predicted_part_follows_the_rule_for_the_records_sizes_and_states_its_source():
    model = {"layers": L, "d_model": H, "heads": A, "vocab": V, "seq_len": S, "d_ff": F}
    record = {**memory_rank_record(0, dp=1), "model": model, "micro_batch": B}
    measured = {"attention": 11_000, "mlp": 9_000, "norms": 5_000, "projection": 4_000, "embeddings": 1_000,
                "cross-entropy": 33_000}
    record["memory"]["peak_fwd_bwd"].update(activation_parts=measured, activations=sum(measured.values()))
    rows = {r.category: r for r in memory_records(record) if r.moment == "peak_fwd_bwd"}
    rule = predicted_parts(B, S, H, A, F, V, L)
    for part, nbytes in measured.items():
        row = rows[f"activations.{part}"]
        assert (row.measured, row.predicted) == (nbytes, rule[part])
        assert row.predicted_source == SOURCE and "saved-tensor hooks" in row.note
    assert rows["activations"].predicted == sum(rule.values())
    b2 = predicted_parts(2 * B, S, H, A, F, V, L)  # linear in the micro-batch except the positions
    assert b2["mlp"] == 2 * rule["mlp"] and b2["embeddings"] == rule["embeddings"] + 8 * B * S
    bar = _memory_state([r.to_dict() for r in memory_records(record)])["bars"]["peak_fwd_bwd"][0]
    assert {p: v["predicted"] for p, v in bar["activation_parts"].items()} == {p: rule[p] for p in measured}
    assert bar["predicted"]["activations"] == sum(rule.values())
    tp = predicted_parts(B, S, H, A, F, V, L, tp=2)  # TP, SP, checkpointing, bf16 and stages have rules too
    rows = {r.category: r for r in memory_records({**record, "dims": {**record["dims"], "tp": 2}})}
    assert rows["activations.attention"].predicted == tp["attention"] < rule["attention"]
    interleaved = {**record, "dims": {**record["dims"], "pp": 2}, "schedule": "interleaved_1f1b", "stage_ids": [0, 2]}
    for other, why in ((interleaved, "one stage per rank"), ({**record, "model": {**model, "family": "llama"}}, "llama")):
        rows = [r for r in memory_records(other) if r.category.startswith("activations")]  # no rule: said so, no number
        assert all(r.predicted is None and why in r.predicted_source for r in rows)
