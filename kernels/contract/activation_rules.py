"""The predicted activation bytes per part of the lab's GPT, beside what ``kernels.measure.activation_parts`` measures.

Standard library only (the driver and the views import it). The parts are those of the
Ultra-Scale Playbook's activation-memory breakdown (after Korthikanti et al., 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4): attention, MLP,
norms, the output projection and the cross-entropy, the embeddings' index tensors, and
``other`` for what a checkpointed block keeps outside its attention and MLP.
Korthikanti counts 16-bit tensors with dropout masks and the a·s² softmax of an unfused
attention (34·s·b·h + 5·a·s²·b bytes per layer, ``korthikanti_layer_bytes``). The lab's
GPT differs in three ways the rule follows instead: no dropout, fp32 or bf16 (below), and
SDPA's fused (flash) kernel, which keeps the (b, a, s) fp32 logsumexp instead of any s×s
matrix. With b = micro-batch, s = sequence, h = d_model, f = d_ff, a = heads, V = vocab,
L = layers on the rank, t = tp, and e the bytes of a matmul output, the parts per layer:

- attention: the normed input (one storage for q, k and v), q, k, v and the SDPA output
  (the out projection's input is a view of it) = b·s·h + 4·b·s·h/t elements, and the
  logsumexp 4·b·(a/t)·s bytes. TP keeps the input whole (replicated; under SP it is the
  all-gathered input, which torch keeps whole where Korthikanti re-gathers it in backward);
- MLP: its input, fc_in's output and GELU's output = b·s·h + 2·b·s·f/t elements;
- norms: 2 LayerNorms per layer and the final one, each its input plus mean and rstd
  per token = (2L + 1)·(b·s·h + 2·b·s)/t_sp, t_sp = t under sequence parallel, else 1;
- projection (``lm_head``): its input, b·s·h (whole: all-gathered under SP);
- embeddings: the int64 token ids (b·s) and positions (s);
- cross-entropy: the fp32 log-softmax of the logits, b·s·V (V/t with loss parallel), the
  int64 targets (b·s) and the loss scalar.

Precision: ``"fp32"``; ``"bf16"`` (FSDP2's policy: bf16 parameters, so every activation
and the norms' statistics are bf16, the logsumexp and the loss fp32); ``"autocast"``
(``torch.autocast``: matmul outputs bf16, norms and the residual stream fp32, and each
matmul keeps the bf16 copies of its input and weight it made: q, k and v each cast the
normed input, 3·b·s·h·2 bytes, and the weight copies add 2·(4·h²/t) per layer in
attention, 2·(2·h·f/t) in the MLP and 2·V·h/t in the projection).

Checkpointing (``kernels.parallel.activation_checkpoint``): full keeps each block's input,
b·s·h/t_sp in the residual stream's dtype, as ``other``; only the final norm is left of
the norms. Selective keeps the block input too, and what its policy saves: the matmul
outputs (attention: q, k, v, b·s·h/t each, and the out projection's b·s·h; MLP: fc_in's
b·s·f/t and fc_out's b·s·h) and, with t > 1, each row-parallel collective's output
(b·s·h all-reduced, or b·s·h/t reduce-scattered under SP); under SP the two all-gathered
block inputs (2·b·s·h, gathered in the module's input hook, so counted in ``other``).

Pipeline stages (``predicted_for``): a stage's parts for one micro-batch times the
micro-batches it holds at its peak: GPipe all m, 1F1B min(p - stage, m) (the first
stage p); embeddings only on the first stage, final norm, projection and loss on the last.
The token ids and targets are views of the rank's whole batch (b·s·m), held whole.
"""
from __future__ import annotations

from typing import Any

FP32 = 4
BF16 = 2
INDEX = 8  # int64 token ids and positions
PRECISIONS = ("fp32", "bf16", "autocast")

SOURCE = ("predicted: the lab GPT's rule (kernels/contract/activation_rules.py): Korthikanti's per-part count without "
          "dropout, in the run's dtypes, fused SDPA (logsumexp, no s×s scores)")


def predicted_parts(b: int, s: int, h: int, a: int, f: int, vocab: int, layers: int, *, tp: int = 1,
                    sequence_parallel: bool = False, loss_parallel: bool = False, checkpointing: bool | str = False,
                    precision: str = "fp32", first: bool = True, last: bool = True) -> dict[str, int]:
    """Bytes saved for backward by each part of one forward of a (b, s) micro-batch through ``layers`` blocks
    (module docstring); ``first``/``last``: the stage holds the embeddings / the final norm, head and loss."""
    t, sp = tp, tp if sequence_parallel else 1
    tok = b * s * h
    act = FP32 if precision == "fp32" else BF16  # matmul outputs, SDPA's output, GELU's
    res = BF16 if precision == "bf16" else FP32  # residual stream and norms: autocast keeps them fp32
    cast = precision == "autocast"  # each matmul keeps bf16 copies of its input and weight
    parts: dict[str, int] = {}
    if first:
        parts["embeddings"] = INDEX * (b * s + s)
    if checkpointing is False:
        lse = FP32 * b * (a // t) * s
        qkv_input = 3 * tok * BF16 + BF16 * 4 * h * h // t if cast else tok * res
        parts["attention"] = layers * (qkv_input + 4 * tok // t * act + lse)
        mlp_input = tok * BF16 + BF16 * 2 * h * f // t if cast else tok * res
        parts["mlp"] = layers * (mlp_input + 2 * b * s * f // t * act)
    elif checkpointing == "selective":
        collective = tok // sp * act if t > 1 else 0  # the row-parallel output, all-reduced or reduce-scattered
        parts["attention"] = layers * (3 * tok // t * act + tok * act + collective)
        parts["mlp"] = layers * (b * s * f // t * act + tok * act + collective)
        gathered = 2 * tok * res if sp > 1 else 0
        parts["other"] = layers * (tok // sp * res + gathered)
    else:
        parts["other"] = layers * tok // sp * res
    norms = (2 * layers if checkpointing is False else 0) + (1 if last else 0)
    if norms:
        parts["norms"] = norms * (tok + 2 * b * s) // sp * res
    if last:
        parts["projection"] = tok * BF16 + BF16 * vocab * h // t if cast else tok * res
        parts["cross-entropy"] = FP32 * b * s * vocab // (t if loss_parallel else 1) + INDEX * b * s + FP32
    return parts


def in_flight(schedule: str, p: int, m: int, stage: int) -> int | None:
    """Micro-batches whose activations ``stage`` holds at its peak: GPipe m, 1F1B min(p - stage, m); None for
    the schedules the rule does not cover (several stages per rank, split backward)."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    return None


def korthikanti_layer_bytes(b: int, s: int, h: int, a: int, t: int = 1, case: str = "none") -> float:
    """Korthikanti et al.'s Table 2, bytes per layer in fp16 with dropout and unfused attention: ``case`` is
    "none", "tp", "tp+sp", "tp+sp+selective" or "full" (full recompute keeps each layer's 16-bit input)."""
    sbh = s * b * h
    return {"none": sbh * (34 + 5 * a * s / h), "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            "tp+sp": sbh / t * (34 + 5 * a * s / h), "tp+sp+selective": 34 * sbh / t, "full": 2 * sbh}[case]


def precision_of(record: dict[str, Any]) -> str:
    """The run's activation dtypes: the rank's own word, else from mixed_precision and who syncs gradients."""
    if record.get("precision"):
        return record["precision"]
    if record.get("mixed_precision") != "bf16":
        return "fp32"
    return "bf16" if "fsdp" in (record.get("strategy"), record.get("dp_strategy")) else "autocast"


def why_not(record: dict[str, Any]) -> str:
    """Why the rule does not apply to a measured rank record (``kernels.train.measured_run``), or "" when it does."""
    if "model" not in record or "micro_batch" not in record:
        return "the record holds no model sizes or micro-batch size"
    if record["model"].get("family"):
        return f"the rule counts the lab GPT's tensors; a {record['model']['family']} model's parts are measured only"
    if record["model"].get("experts"):
        return ("the rule counts a dense MLP's tensors; a mixture of experts' parts (router, routed tokens, "
                "all-to-all buffers) are measured only")
    if record.get("compile"):
        return "torch.compile fuses what is saved; no rule here"
    if record.get("dims", {}).get("pp", 1) > 1:
        if len(record.get("stage_ids", [])) != 1 or in_flight(record.get("schedule", ""), 2, 2, 0) is None:
            return f"the rule covers one stage per rank under gpipe or 1f1b, not {record.get('schedule')}"
        if record.get("activation_checkpointing") == "selective":
            return "selective checkpointing's cache is not counted over a pipeline step"
    return ""


def predicted_for(record: dict[str, Any]) -> dict[str, int] | None:
    """``predicted_parts`` for the model, micro-batch and layout a measured record names (times the micro-batches
    in flight on a pipeline stage); None where the rule does not hold."""
    if why_not(record):
        return None
    m, dims = record["model"], record.get("dims", {})
    layers, first, last, flight = m["layers"], True, True, 1
    if dims.get("pp", 1) > 1:
        stage, stages = record["stage_ids"][0], record["num_stages"]
        layers, first, last = len(record["stage_layers"][str(stage)]), stage == 0, stage == stages - 1
        flight = in_flight(record["schedule"], stages, int(record["microbatches"]), stage)
    d_ff = m.get("d_ff") or 4 * m["d_model"]  # GPTConfig's default
    # A context-parallel rank holds s/cp tokens, and its ring attention keeps what SDPA keeps for them.
    seq = m["seq_len"] // int(dims.get("cp", 1))
    one = predicted_parts(int(record["micro_batch"]), seq, m["d_model"], m["heads"], d_ff, m["vocab"],
                          layers, tp=dims.get("tp", 1), sequence_parallel=bool(record.get("sequence_parallel")),
                          loss_parallel=bool(record.get("loss_parallel")),
                          checkpointing=record.get("activation_checkpointing", False),
                          precision=precision_of(record), first=first, last=last)
    out = {part: nbytes * flight for part, nbytes in one.items()}
    # The rank's batch is split into micro-batches as views of one storage: the token ids and the targets are
    # held whole while any micro-batch is, b·s·m int64 each, not per micro-batch in flight.
    views = INDEX * int(record["micro_batch"]) * seq * (int(record.get("microbatches", 1)) - flight)
    for part in ("embeddings", "cross-entropy"):
        if part in out:
            out[part] += views
    return out
