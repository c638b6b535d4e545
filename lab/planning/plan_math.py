"""The planner's formulas, each one small and named after where it comes from.

Sources: the ZeRO paper (Rajbhandari et al. 2020; its memory and traffic per stage),
nccl-tests' bus bandwidth, Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021),
Korthikanti et al. 2022 (activation recomputation), and the sizing guides of docs/design.md#sources,
whose worked examples the tests reproduce.

Conventions, followed from the sizing guides: GB means 1e9 bytes ("70B × 2 bytes = 140GB"),
and a GPU's "80GB" is 80e9 bytes. Bandwidths are in GB/s (1e9 bytes per second);
``gbps`` converts to the network's Gbit/s ("245GB/s = 1,960Gbps").
Pure Python; no torch.
"""
from __future__ import annotations

import math

GB = 1e9  # The sizing guides' GB: 140GB = 70e9 params × 2 bytes

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}

# Optimizer-state bytes per parameter (K of docs/design.md#zero-formulas), by the training dtype.
# Mixed precision (bf16/fp16) keeps an fp32 master copy beside Adam's two fp32 moments:
# K = 4 + 4 + 4 = 12 (ZeRO paper §3.1; docs/design.md#zero-formulas). In fp32 the parameters are the
# master copy, so only the moments remain: K = 8. "adam_bf16" is the Turing Inc. guide's
# convention (momentum + variance in bf16, no master copy): K = 4, which gives its
# "Optimizer States (Adam): 280GB" for 70B parameters.
OPTIMIZER_BYTES = {
    "adam": {"mixed": 12, "fp32": 8},
    "adam_bf16": {"mixed": 4, "fp32": 4},
    "sgd": {"mixed": 4, "fp32": 0},  # mixed: the fp32 master copy only
    "sgd_momentum": {"mixed": 8, "fp32": 4},
}
_OPT_ALIASES = {"adamw": "adam", "adambf16": "adam_bf16", "adamwbf16": "adam_bf16",
                "sgdmomentum": "sgd_momentum", "momentum": "sgd_momentum"}

# Bytes of saved activations per token, per hidden unit, per layer, in 16-bit training:
# "Activations ≈ batch_size × seq_length × hidden_size × num_layers × 16" (the Turing Inc. guide,
# FSDP memory sizing, "an empirical value covering the attention and feed-forward intermediates").
ACTIVATION_FACTOR = 16
# Selective checkpointing (kernels.parallel.activation_checkpoint) keeps per layer the block input and the
# matmul outputs: q, k, v, out, fc_out (5·b·s·h) and fc_in (b·s·4h): 10 b·s·h elements where the guide counts 16.
SELECTIVE_FACTOR = 10


def dtype_bytes(dtype: str) -> int:
    """Bytes per parameter and gradient element for a training dtype ("bf16", "fp16", "fp32")."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def optimizer_bytes(optimizer: str | float, dtype: str = "bf16") -> float:
    """Optimizer-state bytes per parameter (K). A number is taken as K itself."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        return float(optimizer)
    key = "".join(ch for ch in str(optimizer).lower() if ch.isalnum())
    name = _OPT_ALIASES.get(key, str(optimizer).lower().replace("-", "_"))
    if name not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_BYTES)} "
                         "or a number of bytes per parameter")
    return float(OPTIMIZER_BYTES[name]["fp32" if dtype_bytes(dtype) >= 4 else "mixed"])  # fp64: no master copy either


def zero_memory(psi: float, n: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                opt_bytes: float = 12) -> tuple[float, float, float]:
    """Per-rank (parameters, gradients, optimizer) bytes for ZeRO stage 0-3 (docs/design.md#zero-formulas).

    DDP (2+2+K)Ψ; ZeRO-1 (2+2+K/N)Ψ; ZeRO-2 (2+(2+K)/N)Ψ; ZeRO-3 (2+2+K)Ψ/N. ZeRO-2
    holds whole parameters during forward and backward, which is the peak counted here.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    params = psi * param_bytes / (n if stage >= 3 else 1)
    grads = psi * grad_bytes / (n if stage >= 2 else 1)
    opt = psi * opt_bytes / (n if stage >= 1 else 1)
    return params, grads, opt


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' busbw/algbw factor, which is also wire bytes per rank / payload bytes.

    all_reduce 2(n-1)/n; all_gather, reduce_scatter and all_to_all (n-1)/n (an all-to-all keeps 1/n of
    its input on the rank); broadcast and p2p 1.
    """
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    op = op.lower().replace("-", "_")
    if op in ("all_reduce", "allreduce"):
        return 2 * (n - 1) / n
    if op in ("all_gather", "allgather", "reduce_scatter", "reducescatter", "all_to_all", "alltoall"):
        return (n - 1) / n
    if op in ("broadcast", "p2p", "send", "recv", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def activation_bytes(b: float, s: float, h: float, layers: float, elem_bytes: float = 2) -> float:
    """The sizing guides' activation estimate b·s·h·L·16 bytes for 16-bit training (the Turing Inc. guide).

    The 16 is for 16-bit tensors; fp32 doubles it (``elem_bytes=4``).
    """
    return b * s * h * layers * ACTIVATION_FACTOR * elem_bytes / 2


def checkpointed_activation_bytes(b: float, s: float, h: float, layers: float,
                                  elem_bytes: float = 2) -> float:
    """Full per-block recomputation: each block keeps only its input b·s·h, plus one
    block's full working set while it is recomputed (Korthikanti et al. 2022 §4)."""
    return b * s * h * layers * elem_bytes + activation_bytes(b, s, h, 1, elem_bytes)


def tp_allreduce_bytes(b: float, s: float, h: float, elem_bytes: float = 2) -> float:
    """Payload of one Megatron TP all-reduce: the block output b·s·h (the Turing Inc. guide, TP bandwidth:
    "Hidden_size × Batch_size × Seq_length × 2 bytes" per layer)."""
    return b * s * h * elem_bytes


def pp_p2p_bytes(b: float, s: float, h: float, elem_bytes: float = 2) -> float:
    """Payload of one stage-boundary send: a micro-batch's activation b·s·h (the Turing Inc. guide, PP bandwidth)."""
    return b * s * h * elem_bytes


def fsdp_comm_bytes(param_bytes: float, n: int, reshard_after_forward: bool = True) -> dict[str, float]:
    """Bytes each rank sends per FSDP pass, by collective (the Turing Inc. guide, FSDP bandwidth; docs/design.md#communication-volume).

    Forward all-gather and backward reduce-scatter send param_bytes·(n-1)/n each;
    ``reshard_after_forward`` adds the backward all-gather (docs/design.md#communication-volume: all-gather twice
    plus reduce-scatter once). The sizing guides' 245GB for 70B on 8 GPUs counts only the first two.
    """
    one = param_bytes * busbw_factor("all_gather", n)
    out = {"all_gather_fwd": one, "reduce_scatter_bwd": one}
    if reshard_after_forward:
        out["all_gather_bwd"] = one
    return out


def ep_all_to_all_bytes(tokens: float, hidden: int, elem_bytes: float = 2) -> float:
    """Payload of one expert-parallel all-to-all (a MoE layer's dispatch or combine) on one rank: the
    ``tokens`` copies it routes (b·s·top_k, dropless) of hidden elements each, the share for its own
    experts included, as nccl-tests counts an all-to-all's input; (ep-1)/ep of it crosses the wire."""
    return tokens * hidden * elem_bytes


def cp_ring_bytes(b: float, s_local: float, kv_dim: int, elem_bytes: float = 2) -> float:
    """One ring step of context parallelism: the rank's key and value blocks, 2·b·(s/cp)·kv_heads·head_dim
    elements (sent as one message by ``kernels.parallel.ring_attention``; its float32 gradient is the same count)."""
    return 2 * b * s_local * kv_dim * elem_bytes


def moe_activation_bytes(b: float, s: float, tokens: float, hidden: int, experts: int, elem_bytes: float = 2) -> float:
    """What a MoE layer keeps for backward beyond a dense block's estimate: the ``tokens`` copies dispatched
    to the experts and the per-slot outputs before the gate-weighted sum (2·tokens·hidden elements), and the
    router's fp32 probabilities b·s·E (``kernels.model.moe.MoE.forward``)."""
    return 2 * tokens * hidden * elem_bytes + 4 * b * s * experts


def tp_size_for_memory(params_grads_bytes: float, gpu_mem_bytes: float, act_bytes: float,
                       gpus_per_node: int, max_tp: int = 8) -> tuple[float, int]:
    """The Turing Inc. guide's TP sizing: TP ≥ (Parameters + Gradients) / (GPU_memory − Activations),
    rounded up to a divisor of the node's GPU count, at most min(max_tp, gpus_per_node)
    (the Turing Inc. guide, TP sizing). Returns (the raw ratio, the TP size); the size is capped, so check
    the ratio against it to know whether TP alone suffices."""
    room = gpu_mem_bytes - act_bytes
    if room <= 0:
        return math.inf, min(max_tp, gpus_per_node)
    ratio = params_grads_bytes / room
    cap = min(max_tp, gpus_per_node)
    sizes = [d for d in range(1, cap + 1) if gpus_per_node % d == 0]
    return ratio, next((d for d in sizes if d >= ratio), sizes[-1])


def model_flops_per_token(params: float, layers: int | None, hidden: int | None, seq_len: int,
                          recompute: bool | str = False) -> float:
    """FLOPs one token costs in forward and backward, as the GPU runs them (Narayanan et al. 2021,
    docs/design.md#overlap-model-flops-and-mfu): 6·N for the N weights a token uses, plus 12·l·s·h for the
    attention scores and values (a model known by its count alone has no attention term). Recomputation runs a
    forward again: 2·N + 4·l·s·h under full checkpointing, the attention core's 4·l·s·h under selective."""
    attention = 12.0 * layers * seq_len * hidden if layers and hidden else 0.0
    again = {True: 2.0 * params + attention / 3, "selective": attention / 3}.get(recompute, 0.0)
    return 6.0 * params + attention + again


def required_bandwidth(wire_bytes: float, seconds: float) -> float:
    """GB/s needed to move ``wire_bytes`` in ``seconds`` ("245GB / 1s = 245GB/s", the Turing Inc. guide)."""
    if seconds <= 0:
        raise ValueError(f"target time must be positive, got {seconds}")
    return wire_bytes / seconds / GB


def gbps(gb_per_s: float) -> float:
    """GB/s to the network's Gbit/s (245 GB/s = 1,960 Gbps)."""
    return gb_per_s * 8
