"""Tokens per second, model FLOPs and MFU of a run, with the share of communication hidden behind compute.

Model FLOPs (docs/design.md#overlap-model-flops-and-mfu) follow Narayanan et al., 2021
("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21):
per iteration of B sequences of s tokens through l layers of width h and a vocabulary V,

    F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))

counted here matmul by matmul (2 FLOPs per multiply-add, backward twice the forward), so
that the same count holds for the lab's GPT with any ``d_ff`` and for ``lab.Llama`` (grouped
key/value heads, a gated MLP); with ``d_ff = 4h`` and as many key/value heads as heads it is
exactly the formula above. That is 6·N·tokens for the N weights of the blocks' matmuls and
the head, plus the attention scores and values, 12·l·s·h per token. A model the user
brought is counted 6·N·tokens with N its parameters: no attention term.

MFU is model FLOPs per second over the peak of every device of the run (PaLM's definition:
recomputation is not credited). Hardware FLOPs add what activation checkpointing recomputes
(Narayanan's 96 in place of 72 for full recomputation of each block).

Run alone (the counts of a GPT-2 small shape)::

    python -m lab.measure.throughput
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Mapping
from typing import Any

from kernels.contract.measure_records import Throughput
from kernels.contract.model_rules import is_own_model

# Dense bf16 tensor-core peaks per GPU, FLOP/s, from NVIDIA's data sheets (sparsity doubles them; not counted).
# The most specific name first: torch names an H100 SXM "NVIDIA H100 80GB HBM3", the others "H100 PCIe", "H100 NVL".
PEAK_BF16_DENSE = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12))


def flops_per_token(model: Mapping[str, Any], recompute: bool | str = False,
                    params: int | None = None) -> tuple[float, float, str]:
    """(model FLOPs, hardware FLOPs, formula) of one token's forward and backward.

    ``model`` is a run's model dict (``RunResult.config["model"]``); ``recompute`` the layout's
    ``activation_checkpointing`` (True: every block's forward again; "selective": its attention
    core again, the matmuls kept); ``params`` the parameter count, used for a model the user brought.
    """
    if is_own_model(model):
        if params is None:
            raise ValueError("a model the user brought is counted from its parameters: pass params")
        return 6.0 * params, 6.0 * params, "6·N·tokens (N: every parameter; no attention term)"
    layers, seq, vocab = model["layers"], model["seq_len"], model["vocab"]
    if model.get("family") == "llama":
        hidden, kv_width = model["hidden"], model["hidden"] // model["heads"] * model["kv_heads"]
        mlp = (3 if model.get("gated_mlp", True) else 2) * hidden * model["ffn"]
    else:
        hidden = kv_width = model["d_model"]
        mlp = 2 * hidden * (model.get("d_ff") or 4 * hidden)
    block = 2 * hidden * hidden + 2 * hidden * kv_width + mlp  # multiply-adds per token: q, o, k, v, MLP
    attention = 2 * seq * hidden  # scores q·kᵀ and the weighted sum of v, over the whole window
    forward = 2 * (layers * (block + attention) + hidden * vocab)  # the head: hidden × vocab
    again = {True: 2 * layers * (block + attention), "selective": 2 * layers * attention}.get(recompute, 0)
    return 3.0 * forward, 3.0 * forward + again, "Narayanan et al. 2021: 6·N·tokens + 12·l·s·h·tokens"


def peak_flops(peak: float | str | None) -> float | None:
    """FLOP/s of one device: a number as given, or a GPU's name (``torch.cuda.get_device_name``) looked up in
    ``PEAK_BF16_DENSE``, word by word ("NVIDIA A100-SXM4-80GB" is an A100, "NVIDIA L40S" no L4)."""
    if peak is None or isinstance(peak, (int, float)):
        return None if peak is None else float(peak)
    words = set(re.split(r"[\s_-]+", peak.upper()))
    for name, flops in PEAK_BF16_DENSE:
        if set(name.upper().split()) <= words:
            return flops
    raise ValueError(f"no known peak for {peak!r}: pass FLOP/s, or a name holding one of "
                     f"{[name for name, _ in PEAK_BF16_DENSE]}")


def param_count(layout: list[dict[str, Any]]) -> int:
    """Parameters of the whole model, from every rank's layout record (names counted once)."""
    shapes = {name: p["global_shape"] for rank in layout for name, p in rank.get("params", {}).items()}
    total = 0
    for shape in shapes.values():
        n = 1
        for size in shape:
            n *= size
        total += n
    return total


def run_throughput(config: Mapping[str, Any], step_times: list[list[float]], layout: list[dict[str, Any]],
                   step_waits: list[dict[str, Any]], peak: float | str | None = None) -> Throughput:
    """A run's ``Throughput``: step time (slowest rank, median step, the first left out when there are more)."""
    ranks = [times for times in step_times if times]
    per_step = [max(times[i] for times in ranks) for i in range(min(len(t) for t in ranks))]
    step_s = statistics.median(per_step[1:] if len(per_step) > 1 else per_step)
    tokens = config["global_batch"] * config["model"]["seq_len"]
    recompute = config.get("strategy", {}).get("activation_checkpointing", False)
    model, hardware, formula = flops_per_token(config["model"], recompute, param_count(layout))
    device = peak_flops(peak)
    mfu = None if device is None else model * tokens / step_s / (device * len(ranks))
    hfu = None if device is None else hardware * tokens / step_s / (device * len(ranks))
    later = [w for w in step_waits if w["step"] > 0] or list(step_waits)
    mean = (lambda key: statistics.fmean(w.get(key, 0.0) for w in later)) if later else (lambda key: None)
    return Throughput(tokens_per_step=tokens, step_s=step_s, tokens_per_s=tokens / step_s,
                      model_flops_per_step=model * tokens, hardware_flops_per_step=hardware * tokens,
                      flops_per_s=model * tokens / step_s, devices=len(ranks), peak_flops=device, mfu=mfu, hfu=hfu,
                      formula=formula, comm_s=mean("wait_s"), busy_s=mean("busy_s"), overlap_s=mean("overlap_s"))


if __name__ == "__main__":
    gpt2 = {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50257, "seq_len": 1024, "d_ff": 3072}
    per_token, with_ac, how = flops_per_token(gpt2, recompute=True)
    print(f"GPT-2 small: {per_token / 1e9:.2f} GFLOP per token ({with_ac / 1e9:.2f} recomputing blocks); {how}")
