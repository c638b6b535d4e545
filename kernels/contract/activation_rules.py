"""The predicted activation bytes per part of the lab's GPT, beside what ``kernels.measure.activation_parts`` measures.

Standard library only (the driver and the views import it). The parts are those of the
Ultra-Scale Playbook's activation-memory breakdown (after Korthikanti et al., 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4.1): attention, MLP,
norms, the output projection and the cross-entropy, plus the embeddings' index tensors.
Korthikanti counts 16-bit tensors with dropout masks and the a·s² softmax of an unfused
attention (34·s·b·h + 5·a·s²·b bytes per layer). The lab's GPT differs in three ways the
rule follows instead: no dropout, fp32 (``elem`` bytes per element), and SDPA's fused
(flash) kernel, which keeps the (b, a, s) logsumexp instead of any s×s matrix. With
b = micro-batch, s = sequence, h = d_model, f = d_ff, a = heads, V = vocab, L = layers:

- attention, per layer: the normed input (one storage for q, k and v), q, k, v and the
  SDPA output (the out projection's input is a view of it) = 5·b·s·h elements, and the
  fp32 logsumexp b·a·s;
- MLP, per layer: its input, fc_in's output (GELU's input), GELU's output = b·s·h + 2·b·s·f;
- norms: 2 LayerNorms per layer and the final one, each its input plus fp32 mean and
  rstd per token = (2L + 1)·(b·s·h + 2·b·s);
- projection (``lm_head``): its input, b·s·h;
- embeddings: the int64 token ids (b·s) and positions (s);
- cross-entropy: the fp32 log-softmax of the logits, b·s·V, the int64 targets (b·s; the
  training data's targets are their own tensor) and the loss scalar.

Where the rule does not hold (tensor or sequence parallel, activation checkpointing, mixed
precision, pipeline stages) ``predicted_parts`` returns None and ``why_not`` says why.
"""
from __future__ import annotations

from typing import Any

FP32 = 4
INDEX = 8  # int64 token ids and positions

SOURCE = ("predicted: the lab GPT's rule (kernels/contract/activation_rules.py): Korthikanti's per-part count without dropout, "
          "fp32, fused SDPA (logsumexp, no s×s scores)")


def predicted_parts(b: int, s: int, h: int, a: int, f: int, vocab: int, layers: int,
                    elem: int = FP32) -> dict[str, int]:
    """Bytes saved for backward by each part of one forward of a (b, s) micro-batch (module docstring)."""
    return {
        "attention": layers * (elem * 5 * b * s * h + FP32 * b * a * s),
        "mlp": layers * elem * (b * s * h + 2 * b * s * f),
        "norms": (2 * layers + 1) * (elem * b * s * h + FP32 * 2 * b * s),
        "projection": elem * b * s * h,
        "embeddings": INDEX * (b * s + s),
        "cross-entropy": FP32 * b * s * vocab + INDEX * b * s + FP32,
    }


def why_not(record: dict[str, Any]) -> str:
    """Why the rule does not apply to a measured rank record (``kernels.train.measured_run``), or "" when it does."""
    dims = record.get("dims", {})
    if "model" not in record or "micro_batch" not in record:
        return "the record holds no model sizes or micro-batch size"
    if record["model"].get("family"):
        return f"the rule counts the lab GPT's tensors; a {record['model']['family']} model's parts are measured only"
    if dims.get("tp", 1) > 1:
        return "tensor parallel shards the parts; no rule here"
    if dims.get("pp", 1) > 1:
        return "pipeline stages are measured over a whole schedule step"
    for flag in ("activation_checkpointing", "mixed_precision", "sequence_parallel"):
        if record.get(flag):
            return f"{flag} changes what is saved; no rule here"
    return ""


def predicted_for(record: dict[str, Any]) -> dict[str, int] | None:
    """``predicted_parts`` for the model and micro-batch a measured record names; None where the rule does not hold."""
    if why_not(record):
        return None
    m = record["model"]
    return predicted_parts(int(record["micro_batch"]), m["seq_len"], m["d_model"], m["heads"], m["d_ff"],
                           m["vocab"], m["layers"])
