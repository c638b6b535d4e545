"""A small GPT (decoder-only transformer) that every parallel layout trains.

The model is GPT-2 (Radford et al., 2019, "Language Models are Unsupervised
Multitask Learners") in the style of Karpathy's nanoGPT: pre-LN blocks of causal
multi-head self-attention and a GELU MLP, learned position embeddings, and a final
LayerNorm. It is read in one sitting: Attention -> MLP -> Block -> GPT.

Choices made for the parallel layouts built on top of it:

- Submodule names are short and stable, so tensor-parallel plans are plain dicts
  (``{"attn.q": ColwiseParallel(), "attn.out": RowwiseParallel(), ...}``) and
  checkpoints keep the same keys under every layout.
- ``blocks`` is an ``nn.ModuleDict`` keyed "0".."L-1" (as in torchtitan): a pipeline
  stage deletes the blocks it does not own and the rest keep their names, e.g.
  ``blocks.2.attn.q.weight`` on every stage and in the one-process reference.
- Any of ``tok_emb``/``pos_emb`` and ``norm``/``lm_head`` may be ``None``: a non-first
  stage takes hidden states (B, T, C) and a non-last stage returns them.
  ``keep_stage`` does that split.
- The LM head is not tied to the token embedding, so no weight is shared across
  pipeline stages.
- Attention reads the number of heads from the width of the q projection's output,
  so it works unchanged when tensor parallelism leaves heads/tp heads on each rank.
- Initialisation is seeded per parameter name (``init_weights``), so the weights do
  not depend on the global RNG, on which blocks a stage kept, or on the device.

Run alone (builds the default model, prints its size and one loss)::

    python -m kernels.model.gpt
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from kernels.contract import config_rules
from kernels.model.moe import EXPERT_BIASES, EXPERT_RESIDUALS, MoE, refuse_sequence_parallel


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    d_model: int = 64
    heads: int = 4
    vocab: int = 256
    seq_len: int = 32  # the longest sequence: the number of position embeddings
    d_ff: int | None = None  # MLP hidden width; None means 4 * d_model (set in __post_init__)
    seed: int = 0  # initial weights depend on this seed only (see init_weights)
    bias: bool = True  # biases in Linears and LayerNorms, as in GPT-2
    experts: int = 0  # > 0: each block's MLP is a routed mixture of this many experts (kernels.model.moe)
    top_k: int = 2  # experts each token is routed to
    capacity_factor: float | None = None  # None: dropless; else ceil(factor*T*top_k/experts) per expert and sequence
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the gradient (the reported loss is plain CE)

    def __post_init__(self) -> None:
        if self.d_ff is None and config_rules.is_int(self.d_model):
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        problems = config_rules.model_problems({name: getattr(self, name) for name in config_rules.MODEL_KEYS})
        problems += config_rules.seed_problems({"seed": self.seed})
        if problems:
            raise config_rules.ConfigError(problems)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def tp_sizes(self, sequence_parallel: bool = False) -> dict[str, int]:
        """The sizes tensor parallelism splits (the position table splits over seq_len even without SP; d_ff
        only in a dense MLP: the experts stay whole on each tp rank)."""
        sizes = {"heads": self.heads, "d_model": self.d_model, "d_ff": self.d_ff, "vocab": self.vocab,
                 "seq_len": self.seq_len}
        return {k: v for k, v in sizes.items() if not (self.experts and k == "d_ff")}


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, n*hd) -> (B, n, T, hd): a projection's output as n heads (n = its width / head_dim)."""
    B, T, _ = x.shape
    return x.view(B, T, -1, head_dim).transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of (B, h, T, hd) q, k, v in one process: the attention's default ``attend``, which context
    parallelism replaces by a ring over its ranks (``kernels.parallel.context_parallel``)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        # Separate q/k/v (not one fused c_attn) so each can be sharded column-wise by heads.
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attend = causal_attention  # (q, k, v) -> y; a plain attribute, so context parallelism can swap it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # Under TP the projections give this rank's heads only: (B, T, C/tp), so the
        # head count comes from the output width, not from the config.
        q, k, v = (split_heads(proj(x), self.head_dim) for proj in (self.q, self.k, self.v))  # (B, h, T, hd)
        y = self.attend(q, k, v)  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, h*hd)
        return self.out(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc_in(x))  # (B, T, d_ff), or (B, T, d_ff/tp) under TP
        return self.fc_out(h)  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    The model chooses the four parts (GPT: LayerNorm and GELU MLP; Llama: RMSNorm and SwiGLU);
    they are built in this order by the caller, so a seeded initialisation stays the same.
    """

    def __init__(self, attn_norm: nn.Module, attn: nn.Module, mlp_norm: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(nn.LayerNorm(cfg.d_model, bias=cfg.bias), CausalSelfAttention(cfg),
                                                   nn.LayerNorm(cfg.d_model, bias=cfg.bias),
                                                   MoE.from_config(cfg, cfg.d_model, cfg.d_ff, gated=False)
                                                   if cfg.experts else MLP(cfg))
                                     for i in range(cfg.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        # The input columns' global positions (None: 0..T-1); context parallelism sets the rank's own.
        self.positions: torch.Tensor | None = None  # not a buffer: DDP would broadcast rank 0's to every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) -> logits (B, T, V); a pipeline stage may take or give (B, T, C)."""
        if self.tok_emb is not None:  # first stage: x holds token ids (B, T)
            pos = torch.arange(x.size(1), device=x.device) if self.positions is None else self.positions  # (T,)
            x = self.tok_emb(x) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.norm is not None:
            x = self.norm(x)  # (B, T, C)
        if self.lm_head is not None:  # last stage
            x = self.lm_head(x)  # (B, T, V)
        return x

    def tp_sizes(self, sequence_parallel: bool = False) -> dict[str, int]:
        """The sizes tensor parallelism splits: each must be divisible by tp."""
        return self.config.tp_sizes(sequence_parallel)

    def tp_plan(self, sequence_parallel: bool = False, loss_parallel: bool = False) -> tuple[dict, dict]:
        """(plan of every block, plan of the modules outside them) for ``parallelize_module``; a MoE block's
        plan splits the attention only (every tp rank routes the same tokens through whole experts).
        ConfigError [moe-sp] for sequence parallel with experts."""
        refuse_sequence_parallel(self.config.experts, sequence_parallel)
        mlp = ((), ()) if self.config.experts else (("mlp.fc_in",), ("mlp.fc_out",))
        return (block_tp_plan(sequence_parallel, ("attn.q", "attn.k", "attn.v", *mlp[0]), ("attn.out", *mlp[1])),
                outer_tp_plan(sequence_parallel, loss_parallel))


def block_tp_plan(sequence_parallel: bool, columns: tuple[str, ...], rows: tuple[str, ...]) -> dict[str, Any]:
    """The Megatron TP plan of one Block: ``columns`` split by output, ``rows`` by input (each block output).

    ``kernels.parallel.tensor_parallel`` explains the collectives. A ``Block``'s norms and its
    ``attn``/``mlp`` halves have the same names in every model of the lab; only the projections differ.
    """
    if not sequence_parallel:
        # Each half's input becomes one Replicate DTensor before its projections, as Megatron's one f: q, k and v
        # (gate and up) then sum their Partial input gradients locally and all-reduce once. Left to
        # ColwiseParallel alone, each projection would wrap the input itself and all-reduce its own gradient.
        enter_once = {half: PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
                      for half in ("attn", "mlp") if any(name.startswith(half + ".") for name in columns)}
        return {**enter_once, **{name: ColwiseParallel() for name in columns},
                **{name: RowwiseParallel() for name in rows}}
    # SP: the residual stream between blocks is (B, T/tp, C) on each rank, Shard(1).
    return {
        "attn_norm": SequenceParallel(),  # the norm on (B, T/tp, C)
        # all_gather to (B, T, C); backward: reduce_scatter
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{name: ColwiseParallel() for name in columns},
        **{name: RowwiseParallel(output_layouts=Shard(1)) for name in rows},  # reduce_scatter to (B, T/tp, C)
    }


def outer_tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """The TP plan of the embeddings (``pos_emb`` where the model has one), final norm and LM head."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        # Row-parallel embedding: each rank looks up its vocab rows (zeros elsewhere),
        # forward all_reduce (or reduce_scatter over T under SP), backward identity.
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Positions (T,) -> (T, C): the sequence dim is dim 0 here, so SP shards dim 0.
        "pos_emb": RowwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(0) if sequence_parallel else Replicate()),
        # Column-parallel head: all_gather of the input (SP) then vocab-sharded logits;
        # without loss_parallel the logits are all_gathered to (B, T, V) on every rank.
        # They leave the model as a DTensor and loss_fn takes the local tensor: to_local()
        # returns a view, and an FSDP2 unit that returns a view loses its pre-backward
        # hook to any in-place op on it (torch warns on every forward).
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def param_seed(seed: int, name: str) -> int:
    """A seed for one parameter from the model seed and the parameter's stable name."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2 init: N(0, 0.02) weights, zero biases, unit LayerNorm scales.

    The residual projections (``attn.out``, ``mlp.fc_out``, a MoE's ``mlp.experts.w_out``) get std
    0.02/sqrt(2L), as GPT-2 scales them for the 2L residual additions. Each tensor is drawn on the CPU
    from its own generator seeded by (seed, name), then copied to the parameter's device; a packed
    expert tensor is drawn whole, so an expert's slice does not depend on how experts are sharded.
    """
    std_residual = 0.02 / math.sqrt(2 * model.config.layers)
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, nn.LayerNorm):
                p.fill_(1.0 if p_name == "weight" else 0.0)
            elif p_name == "bias" or p_name in EXPERT_BIASES:
                p.zero_()
            else:
                residual = name.endswith(("attn.out.weight", "mlp.fc_out.weight", *EXPERT_RESIDUALS))
                g = torch.Generator().manual_seed(param_seed(seed, name))
                draw = torch.empty(p.shape).normal_(0.0, std_residual if residual else 0.02, generator=g)
                p.copy_(draw)


def build_gpt(cfg: GPTConfig, device: torch.device | str = "cpu") -> GPT:
    """Build the model with the weights that ``cfg.seed`` fixes (same on every call).

    Modules are created on the meta device (so the global RNG is not used) and then
    materialised on ``device`` and initialised by ``init_weights``.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    init_weights(model, cfg.seed)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over all B*T tokens; logits (B, T, V), targets (B, T).

    Under TP the logits are a DTensor: replicated (each rank holds them whole, so the
    loss is its local tensor's) or, with loss_parallel, sharded on the vocab dim.
    """
    if isinstance(logits, DTensor) and all(p.is_replicate() for p in logits.placements):
        logits = logits.to_local()
    # .float(): compute the softmax in fp32 even when the logits are bf16.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (a DTensor counts with its global shape; shared ones once)."""
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    cfg = GPTConfig()
    gpt = build_gpt(cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    logits = gpt(tokens)  # (2, T, V)
    print(f"{count_parameters(gpt):,} parameters; logits {tuple(logits.shape)}; "
          f"loss {loss_fn(logits, tokens).item():.3f} (ln V = {math.log(cfg.vocab):.3f})")
