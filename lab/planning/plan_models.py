"""Model presets for the analytic planner: parameter counts and transformer shapes.

Each preset carries two parameter counts:

- ``params``: the round figure in the model's name (70e9 for Llama-3 70B). The sizing guides
  (docs/design.md#sources) size everything with it ("70B × 2 bytes = 140GB", the Turing Inc. guide,
  FSDP section; "1.5B × 16 = 24GB", the multi-GPU textbook chapter, §4.2.6), so the planner does
  too, and its figures match theirs.
- ``shape_params``: the count from the real shape (70.55e9 for Llama-3 70B), for
  whoever wants the exact figure: pass ``custom_model(..., params=None)`` or
  ``model.exact()``.

The shapes are the published configs (GPT-2 and GPT-3 papers, Meta's Llama 3 model
cards and config.json files, BERT's paper, the Mixtral paper (Jiang et al. 2024) and its
config.json, the Qwen3 technical report (2025) and Qwen3-30B-A3B's config.json). ResNet-50 has no
transformer shape, so it is known by its parameter count only; activation and TP/PP traffic need a shape.
A mixture of experts (``experts`` > 0) is counted by ``lab.planning.plan_moe``: ``shape_params`` is
the total, ``active_params`` what one token uses. DeepSeek-V3 is not a preset: its multi-head latent
attention (low-rank q and kv projections) and its multi-token-prediction module do not fit this shape.

``ModelSpec.from_gpt(cfg)`` describes the lab's own GPT (``kernels.model.gpt.GPTConfig`` or
its dict) with ``per_tensor=True``: the planner then sizes every rank tensor by tensor
(``lab.planning.plan_tensors.gpt_tensors``: which weights TP splits and on which dim, which it
replicates, which are experts, and which pipeline stage holds them) instead of the sizing guides'
even Ψ/(tp·pp).
Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from lab.planning.plan_moe import idle_params, mlp_params, moe_layer_ids, moe_layer_params, routed_layer_params


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: a parameter count and, where known, a shape."""

    name: str
    params: float  # parameters used for sizing (the nominal figure for presets)
    layers: int | None = None  # transformer blocks
    hidden: int | None = None  # d_model
    heads: int | None = None  # attention (query) heads
    kv_heads: int | None = None  # key/value heads (GQA); None means = heads
    ffn: int | None = None  # MLP inner size
    vocab: int | None = None
    seq_len: int = 2048  # default sequence length when plan() is given none
    gated_mlp: bool = False  # SwiGLU: three ffn matrices instead of two (Llama)
    tied_embeddings: bool = True  # output head shares the input embedding (GPT-2/3, BERT)
    learned_pos: bool = True  # learned position table of seq_len x hidden (GPT, BERT); RoPE has none
    bias: bool = True  # linear and LayerNorm biases (GPT, BERT); Llama has none
    # Each half of a block (attention, MLP) enters the TP region once, as Megatron's one f: one backward
    # all-reduce of its input gradient (fused q/k/v, or the lab's models, whose plan makes each half's input
    # one DTensor). False: a per-projection plan (HF's) wraps each projection's input itself, so TP
    # all-reduces that gradient once per projection: three for q, k, v and two for a gated MLP's gate and up.
    one_tp_input: bool = True
    per_tensor: bool = False  # size shards tensor by tensor (gpt_tensors), as the lab's GPT is built
    # The TP plan splits the token embedding by rows and the head by columns (the lab's GPT and Llama, and
    # the HF decoders whose plans say so), so their collectives are counted (plan_comm_tp._tp_outer_entries).
    sharded_ends: bool = False
    # Sequence parallelism cuts the stream only between the first and the last block (how the lab runs a model
    # the user brought, kernels.model.own_sequence_parallel): the ends and the final norm run whole, and each TP
    # input's gradient is all-reduced as without SP. False: Megatron's SP, which the lab's own models run.
    sp_between_blocks: bool = False
    # The TP plan leaves the embeddings and head whole on every tp rank (GPT-2 under the lab's plan).
    whole_ends: bool = False
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2), where ``bias`` is off
    head_dim: int | None = None  # per-head width; None means hidden / heads (Qwen3 sets 128 with hidden 2048)
    qk_norm: bool = False  # an RMSNorm on each head's q and k (Qwen3): 2·head_dim weights per layer
    # A mixture of experts (lab.planning.plan_moe): E routed experts per MoE layer, top_k of them per token.
    experts: int = 0  # 0: a dense model
    top_k: int = 2
    expert_ffn: int | None = None  # each expert's MLP width; None means ffn (which the dense layers use)
    moe_every: int = 1  # layer i routes when (i + 1) % moe_every == 0 (HF's decoder_sparse_step)
    dense_first: int = 0  # the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)
    shared_experts: int = 0  # experts every token runs (width expert_ffn), counted as dense weights
    capacity_factor: float | None = None  # None: dropless; else each expert takes ceil(c·s·top_k/E) per sequence

    @classmethod
    def from_gpt(cls, cfg: Any, name: str | None = None) -> "ModelSpec":
        """The lab's GPT (``kernels.model.gpt.GPTConfig`` or a dict of its fields), counted exactly.

        Untied LM head without bias, learned positions, LayerNorm and Linear biases when
        ``bias`` (GPT-2), separate q/k/v, and with ``experts`` a mixture of experts of width d_ff in
        every block (``kernels.model.moe``); ``params`` is the exact count.
        """
        get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
        d_model = int(get("d_model", 64))
        d_ff = get("d_ff", None)
        spec = cls(name or f"lab GPT L{get('layers', 4)} d{d_model}", 0.0, int(get("layers", 4)), d_model,
                   int(get("heads", 4)), None, int(d_ff) if d_ff is not None else 4 * d_model,
                   int(get("vocab", 256)), seq_len=int(get("seq_len", 32)), tied_embeddings=False,
                   bias=bool(get("bias", True)), per_tensor=True,
                   sharded_ends=True, **experts_of(get))
        return dataclasses.replace(spec, params=spec.shape_params)

    @property
    def has_shape(self) -> bool:
        """True when layers and hidden are known, so activations and TP/PP traffic can be sized."""
        return self.layers is not None and self.hidden is not None

    @property
    def shape_params(self) -> float | None:
        """Parameters counted from the shape, or None for a count-only model."""
        if not self.has_shape or self.ffn is None or self.vocab is None:
            return None
        return float(_count_from_shape(self))

    @property
    def expert_params(self) -> float:
        """Routed expert weights of the whole model, from the shape (0 for a dense model)."""
        return float(len(moe_layer_ids(self)) * routed_layer_params(self)) if self.experts else 0.0

    @property
    def active_params(self) -> float | None:
        """Parameters one token uses: the shape's count less the routed experts it is not sent to."""
        total = self.shape_params
        return None if total is None else total - idle_params(self)

    def exact(self) -> "ModelSpec":
        """The same model sized by its shape-derived count instead of the nominal one."""
        exact = self.shape_params
        if exact is None:
            return self
        return dataclasses.replace(self, params=exact, name=f"{self.name} (exact)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return dataclasses.asdict(self)


def _count_from_shape(m: ModelSpec) -> int:
    """Weights of a decoder/encoder stack: attention, MLP (or mixture of experts), norms, embeddings, head."""
    h, heads = m.hidden, m.heads or 1
    head_dim = m.head_dim or h // heads
    q_dim, kv_dim = heads * head_dim, (m.kv_heads or heads) * head_dim  # GQA shrinks only k and v
    attn = 2 * h * q_dim + 2 * h * kv_dim + (2 * head_dim if m.qk_norm else 0)
    attn += q_dim + h + 2 * kv_dim if m.bias else q_dim + 2 * kv_dim if m.qkv_bias else 0
    mlp = mlp_params(h, m.ffn, m.gated_mlp, m.bias)
    norms = (4 if m.bias else 2) * h  # two norms per block, weight (+ bias)
    embed = m.vocab * h + (m.seq_len * h if m.learned_pos else 0)
    head = 0 if m.tied_embeddings else m.vocab * h
    routed = len(moe_layer_ids(m))
    blocks = m.layers * (attn + norms) + (m.layers - routed) * mlp + routed * moe_layer_params(m)
    return blocks + embed + head + (2 if m.bias else 1) * h


def experts_of(get: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of a lab model config (GPTConfig, LlamaConfig or their dict) read through
    ``get(key, default)``: {} for a dense one (experts 0), so its spec stays the dense one."""
    experts = int(get("experts", 0) or 0)
    if not experts:
        return {}
    return {"experts": experts, "top_k": int(get("top_k", 2)), "capacity_factor": get("capacity_factor", None)}


_LLAMA = dict(gated_mlp=True, tied_embeddings=False, learned_pos=False, bias=False, vocab=128256)

PRESETS: dict[str, ModelSpec] = {
    "gpt2-1.5b": ModelSpec("gpt2-1.5b", 1.5e9, 48, 1600, 25, None, 6400, 50257, seq_len=1024),
    "gpt3-175b": ModelSpec("gpt3-175b", 175e9, 96, 12288, 96, None, 49152, 50257, seq_len=2048),
    "llama3-8b": ModelSpec("llama3-8b", 8e9, 32, 4096, 32, 8, 14336, seq_len=8192, **_LLAMA),
    "llama3-70b": ModelSpec("llama3-70b", 70e9, 80, 8192, 64, 8, 28672, seq_len=8192, **_LLAMA),
    "llama3.1-405b": ModelSpec("llama3.1-405b", 405e9, 126, 16384, 128, 8, 53248, seq_len=8192,
                               **_LLAMA),
    # Llama-2 70B is the 70B row of the model table in the Rust tutorial's distributed chapter; same
    # blocks as Llama-3 70B, 32k vocab, 4k context.
    "llama2-70b": ModelSpec("llama2-70b", 70e9, 80, 8192, 64, 8, 28672, seq_len=4096,
                            **{**_LLAMA, "vocab": 32000}),
    "bert-base": ModelSpec("bert-base", 110e6, 12, 768, 12, None, 3072, 30522, seq_len=512),
    # Mixtral 8x7B (Jiang et al. 2024, Table 1; its config.json): Mistral 7B's blocks with 8 SwiGLU experts of
    # width 14336 in every layer, 2 per token, 32k context: 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 46.7e9, 32, 4096, 32, 8, 14336, seq_len=32768,
                              **{**_LLAMA, "vocab": 32000}, experts=8, top_k=2),
    # Qwen3-30B-A3B (Qwen3 technical report 2025, Table 2; its config.json): 48 layers of 128 experts of width
    # 768, 8 per token, 32 query / 4 key-value heads of 128 (wider than hidden / heads), q/k norms, 32k native
    # context: 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", 30.5e9, 48, 2048, 32, 4, 6144, seq_len=32768,
                               **{**_LLAMA, "vocab": 151936}, head_dim=128, qk_norm=True, experts=128,
                               top_k=8, expert_ffn=768),
    # The Rust tutorial's distributed chapter lists ResNet-50 at 25M parameters (the real count is
    # 25.6M); no transformer shape.
    "resnet-50": ModelSpec("resnet-50", 25e6),
}

_ALIASES = {
    "gpt2xl": "gpt2-1.5b", "gpt21.5b": "gpt2-1.5b", "gpt3": "gpt3-175b", "llama38b": "llama3-8b",
    "llama370b": "llama3-70b", "llama31405b": "llama3.1-405b", "llama3405b": "llama3.1-405b",
    "llama270b": "llama2-70b", "bert": "bert-base", "bertbase": "bert-base",
    "bertbaseuncased": "bert-base", "resnet50": "resnet-50", "resnet": "resnet-50", "mixtral": "mixtral-8x7b",
    "qwen330b": "qwen3-30b-a3b", "qwen3moe": "qwen3-30b-a3b",
}


def _key(name: str) -> str:
    """Lower-case and drop separators, so "Llama-3-70B", "llama3_70b" and "llama3-70b" agree."""
    return "".join(ch for ch in name.lower() if ch.isalnum())


_LOOKUP = {**{_key(k): k for k in PRESETS}, **{_key(k): v for k, v in _ALIASES.items()}}


def custom_model(name: str = "custom", *, params: float | None = None, layers: int | None = None,
                 hidden: int | None = None, heads: int | None = None, ffn: int | None = None,
                 vocab: int | None = None, **shape: Any) -> ModelSpec:
    """A model by shape (layers, hidden, heads, ffn, vocab), by parameter count, or both.

    Given a shape and no ``params``, the count comes from the shape. ``ffn`` defaults to
    4·hidden (GPT) and ``heads`` to hidden/128. Extra keywords are ModelSpec fields
    (kv_heads, seq_len, gated_mlp, tied_embeddings, learned_pos, bias, head_dim, and a mixture of
    experts': experts, top_k, expert_ffn, moe_every, dense_first, shared_experts, capacity_factor).
    """
    if params is None and (layers is None or hidden is None or vocab is None):
        raise ValueError("a custom model needs params=..., or layers, hidden and vocab")
    if hidden is not None:
        ffn = ffn if ffn is not None else 4 * hidden
        heads = heads if heads is not None else max(1, hidden // 128)
    spec = ModelSpec(name, float(params or 0.0), layers, hidden, heads, ffn=ffn, vocab=vocab, **shape)
    if params is None:
        spec = dataclasses.replace(spec, params=spec.shape_params)
    if spec.params <= 0:
        raise ValueError(f"parameter count must be positive, got {spec.params}")
    return spec


def get_model(model: str | float | int | ModelSpec | Mapping[str, Any] | Any) -> ModelSpec:
    """Resolve a preset name (any case/separators), a ModelSpec, a dict of fields, or a count.

    A ``kernels.model.gpt.GPTConfig``, or a dict with ``d_model`` (its field names), is the
    lab's GPT: ``ModelSpec.from_gpt``, sized tensor by tensor.
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Mapping) and "d_model" in model or hasattr(model, "d_model"):
        return ModelSpec.from_gpt(model)  # the lab's GPTConfig, or its dict
    if isinstance(model, Mapping):
        return custom_model(**dict(model))
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if not math.isfinite(model) or model <= 0:
            raise ValueError(f"parameter count must be positive, got {model}")
        return custom_model(f"{model / 1e9:g}B params", params=float(model))
    if isinstance(model, str):
        canonical = _LOOKUP.get(_key(model))
        if canonical is None:
            raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)}, "
                             "or pass custom_model(...) / a dict / a parameter count")
        return PRESETS[canonical]
    raise TypeError(f"model must be a name, a count, a dict or a ModelSpec, not {type(model).__name__}")
