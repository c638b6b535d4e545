"""A Llama-style decoder whose shapes come from a config dict, built for meta-device sizing.

The model is Llama 3 (Grattafiori et al., 2024, "The Llama 3 Herd of Models";
Touvron et al., 2023, "LLaMA"): pre-norm blocks of RMSNorm (Zhang & Sennrich, 2019),
grouped-query attention with rotary positions (Ainslie et al., 2023, "GQA"; Su et al.,
2021, "RoFormer") and a SwiGLU MLP (Shazeer, 2020, "GLU Variants Improve Transformer"),
with an output head that is not tied to the token embedding. It is read in one sitting:
Attention -> MLP -> Block -> Llama.

Why it exists beside ``kernels.model.gpt.GPT``: ``kernels.measure.dry_run`` builds one rank's shard
of a 70B/405B layout on the ``meta`` device, where nothing is allocated, so the shapes
must be the real ones. Choices made for that:

- q/k/v/o are separate Linears (k and v are ``kv_heads * head_dim`` wide), and the MLP
  is gate/up/down, so the Megatron TP plan is a plain dict (colwise q/k/v/gate/up,
  rowwise o/down), as in torchtitan.
- ``blocks`` is an ``nn.ModuleDict`` keyed "0".."L-1", so a pipeline stage deletes the
  blocks it does not own and the rest keep their names (``keep_layers``).
- The same class also covers the GPT-style presets of ``lab.planning.plan_models`` when asked:
  ``gated_mlp=False`` (two MLP matrices, GELU), ``bias=True`` (biases, LayerNorm),
  ``learned_pos=True`` (a position table) and ``tied_embeddings=True``, so a parameter
  count from this model equals the planner's shape-derived count.
- Attention reads its head counts from the widths of q and k, so it runs unchanged when
  tensor parallelism leaves heads/tp and kv_heads/tp heads on each rank.

Run alone (builds Llama-3-70B on meta and prints its parameter count)::

    python -m kernels.model.llama
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from kernels.contract import config_rules, layout_rules
from kernels.model.gpt import Block, block_tp_plan, count_parameters, outer_tp_plan, param_seed, split_heads
from kernels.model.moe import EXPERT_BIASES, EXPERT_RESIDUALS, MoE, refuse_sequence_parallel


@dataclass(frozen=True)
class LlamaConfig:
    layers: int = 2
    hidden: int = 64  # d_model
    heads: int = 4  # query heads
    kv_heads: int | None = None  # key/value heads (GQA); None means = heads
    ffn: int = 256  # MLP inner width
    vocab: int = 256
    seq_len: int = 32  # only sizes the learned position table, when there is one
    gated_mlp: bool = True  # SwiGLU gate/up/down; False: GPT's up/down with GELU
    tied_embeddings: bool = False  # lm_head reuses tok_emb.weight
    learned_pos: bool = False  # a (seq_len, hidden) position table instead of RoPE
    bias: bool = False  # Linear biases and LayerNorm instead of RMSNorm (GPT, BERT)
    rope_theta: float = 500000.0  # Llama 3's RoPE base
    norm_eps: float = 1e-5
    seed: int = 0  # a trained Llama's initial weights depend on this seed only (init_weights)
    experts: int = 0  # > 0: each block's MLP is a routed mixture of this many experts (kernels.model.moe)
    top_k: int = 2  # experts each token is routed to
    capacity_factor: float | None = None  # None: dropless; else ceil(factor*T*top_k/experts) per expert and sequence
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the gradient (the reported loss is plain CE)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        fields = {name: getattr(self, name) for name in config_rules.LLAMA_KEYS if name != "family"}
        problems = config_rules.llama_problems(fields) + config_rules.seed_problems({"seed": self.seed})
        if problems:  # the rules a run's model dict meets on the ranks too (kernels.contract.config_rules)
            raise config_rules.ConfigError(problems)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tp_sizes(self, sequence_parallel: bool = False) -> dict[str, int]:
        """The sizes tensor parallelism splits: query and key/value heads, the MLP width, the vocabulary;
        the sequence too under sequence parallel (and the position table, where there is one); not the MLP
        width of experts, which stay whole on each tp rank."""
        sizes = {"heads": self.heads, "kv_heads": self.kv_heads, "vocab": self.vocab,
                 **({} if self.experts else {"ffn": self.ffn})}
        return {**sizes, "seq_len": self.seq_len} if sequence_parallel or self.learned_pos else sizes

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        """From a plain dict (e.g. ``ModelSpec.to_dict()``); keys that are not fields are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names and v is not None})


def _norm(cfg: LlamaConfig) -> nn.Module:
    if cfg.bias:
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)


def rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate (B, h, T, hd) by position (rotate-half form, as in Hugging Face Llama): ``positions`` (T,) are the
    rows' global positions, 0..T-1 by default (a context-parallel rank holds others)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)  # (hd/2,)
    pos = torch.arange(T, device=x.device, dtype=torch.float32) if positions is None else positions.float()
    angles = torch.outer(pos, inv)  # (T, hd/2)
    cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)  # (T, hd)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query SDPA in one process: the attention's default ``attend`` (context parallelism
    replaces it by a ring over its ranks, ``kernels.parallel.context_parallel``)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim, self.theta, self.use_rope = cfg.head_dim, cfg.rope_theta, not cfg.learned_pos
        kv_dim = cfg.kv_heads * cfg.head_dim  # GQA shrinks only k and v
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.attend = causal_gqa_attention  # (q, k, v) -> y; a plain attribute, so context parallelism can swap it
        self.positions: torch.Tensor | None = None  # what RoPE rotates by (None: 0..T-1; context parallelism sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # Under TP these are this rank's heads/tp query and kv_heads/tp key/value heads.
        q = split_heads(self.q(x), self.head_dim)  # (B, h, T, hd)
        k, v = split_heads(self.k(x), self.head_dim), split_heads(self.v(x), self.head_dim)  # (B, kv, T, hd)
        if self.use_rope:
            q, k = rope(q, self.theta, self.positions), rope(k, self.theta, self.positions)
        y = self.attend(q, k, v)  # (B, h, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); without gating, GPT's down(gelu(up(x)))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias) if cfg.gated_mlp else None
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(F.gelu(self.up(x)))  # (B, T, C)
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, ffn[/tp]) -> (B, T, C)


def _mlp(cfg: LlamaConfig) -> nn.Module:
    if cfg.experts:
        return MoE.from_config(cfg, cfg.hidden, cfg.ffn, gated=cfg.gated_mlp)
    return MLP(cfg)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.learned_pos else None
        self.blocks = nn.ModuleDict({str(i): Block(_norm(cfg), Attention(cfg), _norm(cfg), _mlp(cfg))
                                     for i in range(cfg.layers)})
        self.norm: nn.Module | None = _norm(cfg)
        # Tied: no head module; forward reuses tok_emb.weight (one copy of the vocab matrix).
        self.lm_head: nn.Linear | None = None if cfg.tied_embeddings else nn.Linear(cfg.hidden, cfg.vocab,
                                                                                     bias=False)
        self.positions: torch.Tensor | None = None  # the input columns' global positions, as the GPT's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) -> logits (B, T, V); a pipeline stage may take or give (B, T, C)."""
        if self.tok_emb is not None and not x.is_floating_point():  # first stage: token ids (B, T)
            h = self.tok_emb(x)  # (B, T, C)
            if self.pos_emb is not None:
                pos = torch.arange(x.size(1), device=x.device) if self.positions is None else self.positions
                h = h + self.pos_emb(pos)  # (T, C) broadcast
            x = h
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.norm is None:  # not the last stage
            return x
        x = self.norm(x)  # (B, T, C)
        if self.lm_head is not None:  # the module itself, so that a TP plan on it applies
            return self.lm_head(x)  # (B, T, V)
        return F.linear(x, self.tok_emb.weight)  # tied: (B, T, V)

    def tp_sizes(self, sequence_parallel: bool = False) -> dict[str, int]:
        """The sizes tensor parallelism splits: each must be divisible by tp."""
        return self.config.tp_sizes(sequence_parallel)

    def tp_plan(self, sequence_parallel: bool = False, loss_parallel: bool = False) -> tuple[dict, dict]:
        """Megatron's plan, as the GPT's: q/k/v/gate/up column-wise, o/down row-wise; the embedding
        row-parallel over the vocab, the head column-parallel over it; with sequence parallel the norms
        work on sequence shards, with loss parallel the logits stay sharded over the vocab. A MoE block's plan
        splits the attention only; ConfigError [moe-sp] for sequence parallel with experts."""
        refuse_sequence_parallel(self.config.experts, sequence_parallel)
        dense = not self.config.experts
        columns = ("attn.q", "attn.k", "attn.v") + (("mlp.up",) if dense else ()) \
            + (("mlp.gate",) if dense and self.config.gated_mlp else ())
        return (block_tp_plan(sequence_parallel, columns, ("attn.o",) + (("mlp.down",) if dense else ())),
                outer_tp_plan(sequence_parallel, loss_parallel))


def build_llama(cfg: LlamaConfig | Mapping[str, Any], device: str | torch.device = "meta",
                dtype: torch.dtype = torch.bfloat16) -> Llama:
    """Build the model on ``device`` (``meta``: shapes only, nothing allocated) in ``dtype``.

    On a real device the weights are the ones ``cfg.seed`` fixes (``init_weights``): the same on
    every rank and in the one-process reference, with no broadcast.
    """
    cfg = cfg if isinstance(cfg, LlamaConfig) else LlamaConfig.from_dict(cfg)
    with torch.device("meta"):
        model = Llama(cfg)
    if str(device) == "meta":
        return model.to(dtype)
    model.to_empty(device=device)
    init_weights(model, cfg.seed)
    return model.to(dtype)


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """N(0, 0.02) matrices and embeddings, unit norm scales, zero biases; the residual projections
    (``attn.o``, ``mlp.down``, a MoE's ``mlp.experts.w_down``) 0.02/sqrt(2L), as GPT-2 scales them. Each
    tensor is drawn on the CPU from its own generator seeded by (seed, name), so the weights do not
    depend on the device or on the order modules are built in (a packed expert tensor is drawn whole)."""
    std_residual = 0.02 / math.sqrt(2 * model.config.layers)
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                p.fill_(1.0 if p_name == "weight" else 0.0)
            elif p_name == "bias" or p_name in EXPERT_BIASES:
                p.zero_()
            else:
                std = std_residual if name.endswith(("attn.o.weight", "mlp.down.weight", *EXPERT_RESIDUALS)) else 0.02
                g = torch.Generator().manual_seed(param_seed(seed, name))
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))


def keep_layers(model: nn.Module, stage: int, num_stages: int, stage_layers: Sequence[int] | None = None) -> nn.Module:
    """Cut ``model`` (a Llama, or the GPT: both hold ``tok_emb``, ``pos_emb``, ``blocks``, ``norm`` and
    ``lm_head``) in place to one pipeline stage: its blocks under their names, plus the embeddings on
    the first stage and the final norm and head on the last. The stages may be uneven (a dry run's), or
    hold the blocks ``stage_layers`` gives each (``layout_rules.layer_split``).

    A tied head on a last stage that is not also the first gets its own copy of the vocab
    matrix (as Megatron does; the two copies are all-reduced in backward).
    """
    keep = {str(i) for i in layout_rules.layer_split(model.config.layers, num_stages, stage, stage_layers)}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    last = stage == num_stages - 1
    if last and stage != 0 and model.lm_head is None:
        emb = model.tok_emb.weight
        model.lm_head = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device=emb.device, dtype=emb.dtype)
    if stage != 0:
        model.tok_emb = model.pos_emb = None
    if not last:
        model.norm = model.lm_head = None
    return model


if __name__ == "__main__":
    llama3_70b = LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
    print(f"Llama-3-70B on meta: {count_parameters(build_llama(llama3_70b)):,} parameters")
