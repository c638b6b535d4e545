"""A routed mixture of experts (MoE) in place of a block's MLP, for the lab's GPT and Llama.

Algorithm (Shazeer et al., 2017, "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer"; Lepikhin et al., 2020, "GShard"; Fedus et al., 2021, "Switch
Transformers"; Jiang et al., 2024, "Mixtral of Experts"):

1. Route: a bias-free linear router scores each token against the E experts; the softmax over
   experts is taken in fp32. Each token picks its top_k experts by a stable sort, so on equal
   probabilities the lower expert index wins (``torch.topk`` leaves the order of ties unspecified).
   The gates are the chosen probabilities renormalised to sum 1 over the k choices when k > 1
   (Mixtral), the raw probability when k == 1 (Switch).
2. Capacity (only with ``capacity_factor``; dropless otherwise): each expert takes at most
   ceil(capacity_factor * T * top_k / E) assignments PER SEQUENCE, so what is dropped does not depend
   on how a batch is split over ranks. Priority goes first by choice slot (every first choice before
   any second choice, GShard), then by position in the sequence. A dropped assignment adds nothing:
   the residual stream carries the token past the layer.
3. Dispatch: the kept assignments are sorted by expert (stable) and ``dispatch(tokens, counts)`` runs
   each expert on its contiguous slice. Expert parallelism replaces only this step (an all_to_all that
   runs the local experts), so ``dispatch`` is an overridable method.
4. Combine: each output goes back to its (token, slot) place and the k slots are summed weighted by
   their gates: the weighted scatter-add, written as an un-sort and a sum over the slots so that the
   summation order is fixed (an index_add on a GPU adds in an unspecified order).

The load-balancing loss is Switch's E * sum_i f_i * P_i, with f_i the fraction of the k*T assignments
routed to expert i before dropping and P_i the mean router probability of expert i, computed per
sequence and averaged over sequences (DeepSeek-V3's sequence-wise form of Switch's loss), again so it
does not depend on the batch split. It enters the gradient, not the output: ``AddAuxGradient`` returns
the MoE output unchanged and, in backward, also gives the aux loss the gradient ``aux_loss_coef`` (the
idea of DeepSeek-V2's AddAuxiliaryLoss), so the loss function and the reported loss stay the plain
cross-entropy. A loop that accumulates m micro-batches by dividing the loss by m calls
``scale_aux_gradient(model, 1 / m)``, so the aux gradient is divided too and the step's gradient is
the full batch's (the reference, the flat step and the pipeline's micro-batch mean loss do).

The experts are packed parameters with the expert index first (``PackedExperts``), so an
expert-parallel layout shards dim 0 and each rank keeps whole experts.

Run alone (routes a random batch and prints what the router did)::

    python -m kernels.model.moe
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.contract import config_rules

# The packed biases (initialised to zero) and the matrices that write into the residual stream
# (initialised with the residual std): ``kernels.model.gpt.init_weights`` and its Llama twin read these.
EXPERT_BIASES = ("b_in", "b_out", "b_gate", "b_up", "b_down")
EXPERT_RESIDUALS = ("experts.w_out", "experts.w_down")


class PackedExperts(nn.Module):
    """E expert MLPs held as tensors of shape (E, in, out), expert index first.

    GELU experts (``gated=False``, GPT's MLP): ``w_in`` (E, d_model, hidden), ``w_out`` (E, hidden, d_model).
    SwiGLU experts (``gated=True``, Llama's MLP): ``w_gate``, ``w_up`` (E, d_model, hidden), ``w_down``
    (E, hidden, d_model). With ``bias``, each ``w_<part>`` has a ``b_<part>`` of shape (E, out).
    A token row x goes through expert e as ``x @ w_in[e]``: no transpose, unlike ``nn.Linear``.
    """

    def __init__(self, experts: int, d_model: int, hidden: int, *, gated: bool, bias: bool) -> None:
        super().__init__()
        self.gated = gated
        parts = {"gate": (d_model, hidden), "up": (d_model, hidden), "down": (hidden, d_model)} if gated \
            else {"in": (d_model, hidden), "out": (hidden, d_model)}
        for part, (fan_in, fan_out) in parts.items():
            self.register_parameter(f"w_{part}", nn.Parameter(torch.empty(experts, fan_in, fan_out)))
            if bias:
                self.register_parameter(f"b_{part}", nn.Parameter(torch.empty(experts, fan_out)))

    def _project(self, x: torch.Tensor, part: str, e: int) -> torch.Tensor:
        y = x @ getattr(self, f"w_{part}")[e]
        bias = getattr(self, f"b_{part}", None)
        return y if bias is None else y + bias[e]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (an index into the tensors this module holds) on its tokens: (n, C) -> (n, C)."""
        if self.gated:
            return self._project(F.silu(self._project(x, "gate", e)) * self._project(x, "up", e), "down", e)
        return self._project(F.gelu(self._project(x, "in", e)), "out", e)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert on its contiguous slice: ``tokens`` (n, C) sorted by expert, ``counts`` (E,) -> (n, C)."""
        slices = tokens.split(counts.tolist())  # the one host sync of a dropless forward: slice sizes
        return torch.cat([self.expert(e, rows) for e, rows in enumerate(slices)])


class AddAuxGradient(torch.autograd.Function):
    """Identity on ``output``; in backward also gives ``aux`` the gradient ``coef``.

    The same gradient as adding ``coef * aux`` to the loss, without changing the loss the training
    loop computes and reports.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef, ctx.aux_dtype = coef, aux.dtype
        return output.view_as(output)  # a view, not the input itself, so the input keeps its own grad_fn

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full((), ctx.coef, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, aux_grad, None


def choose_experts(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, gates), each (..., top_k), from router probabilities (..., E).

    A stable descending sort: on equal probabilities the lower expert index comes first.
    Gates are renormalised over the k choices when k > 1 (Mixtral), raw when k == 1 (Switch).
    """
    chosen, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    chosen, ids = chosen[..., :top_k], ids[..., :top_k]
    gates = chosen / chosen.sum(dim=-1, keepdim=True) if top_k > 1 else chosen
    return ids, gates


def expert_capacity(capacity_factor: float, seq_len: int, top_k: int, experts: int) -> int:
    """Assignments each expert takes from one sequence: ceil(capacity_factor * T * top_k / E)."""
    return math.ceil(capacity_factor * seq_len * top_k / experts)


def within_capacity(choice: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which assignments an expert keeps, (B, T, k) bool, from the one-hot choices (B, T, k, E).

    Within a sequence an expert keeps its first ``capacity`` assignments in slot-major order:
    every first choice (by position) before any second choice (GShard's priority).
    """
    B, T, k, E = choice.shape
    slot_major = choice.transpose(1, 2).reshape(B, k * T, E)  # (B, kT, E)
    position = (slot_major.cumsum(dim=1) * slot_major).sum(dim=-1) - 1  # place in its expert's queue, (B, kT)
    return (position < capacity).view(B, k, T).transpose(1, 2)  # (B, T, k)


def balance_loss(probs: torch.Tensor, assigned: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch's load-balancing loss per sequence, averaged over sequences (DeepSeek-V3's sequence-wise form).

    ``probs`` (B, T, E) router probabilities; ``assigned`` (B, E) assignments per expert before dropping.
    E * sum_i f_i * P_i is 1 when routing is uniform and grows as it concentrates.
    """
    B, T, E = probs.shape
    fraction = assigned.float() / (T * top_k)  # f_i: no gradient, a count
    return (E * (fraction * probs.mean(dim=1)).sum(dim=-1)).mean()


class MoE(nn.Module):
    """A routed mixture of ``experts`` MLPs, each token sent to ``top_k`` of them (module docstring).

    ``router`` is ``nn.Linear(d_model, experts, bias=False)``; ``experts`` a ``PackedExperts``.
    (B, T, C) -> (B, T, C). ``routing_stats()`` reads what the last forward did.
    """

    def __init__(self, d_model: int, hidden: int, experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.01, gated: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = PackedExperts(experts, d_model, hidden, gated=gated, bias=bias)
        self.aux_grad_scale = 1.0  # 1/m where the loop divides the loss over m micro-batches (scale_aux_gradient)
        self._last: dict[str, Any] | None = None  # the last forward's counts, as tensors until asked for

    @classmethod
    def from_config(cls, cfg: Any, d_model: int, hidden: int, *, gated: bool) -> "MoE":
        """The MoE a model config (GPTConfig, LlamaConfig) asks for with its mixture-of-experts fields and bias."""
        return cls(d_model, hidden, cfg.experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                   aux_loss_coef=cfg.aux_loss_coef, gated=gated, bias=cfg.bias)

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run the experts: ``tokens`` (n, C) sorted by expert, ``counts`` (E,) int64 rows per expert on
        the tokens' device (summing to n) -> outputs (n, C) in the same order.

        The default runs every expert here (``PackedExperts.forward``). Expert parallelism replaces it
        per instance (``moe.dispatch = fn`` with this signature) by an all_to_all that runs the local experts.
        """
        return self.experts(tokens, counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        E, k = self.num_experts, self.top_k
        probs = F.softmax(self.router(x).float(), dim=-1)  # (B, T, E), fp32 even under bf16
        ids, gates = choose_experts(probs, k)  # (B, T, k) each
        choice = F.one_hot(ids, E)  # (B, T, k, E)
        assigned = choice.sum(dim=(1, 2))  # (B, E) per sequence, before dropping
        expert_of = ids.reshape(-1)  # (B*T*k,): assignment (b*T + t)*k + s
        if self.capacity_factor is not None:
            keep = within_capacity(choice, expert_capacity(self.capacity_factor, T, k, E))
            expert_of = torch.where(keep.reshape(-1), expert_of, E)  # dropped: a bucket after every expert
        order = torch.argsort(expert_of, stable=True)  # by expert, then by assignment
        counts = torch.bincount(expert_of, minlength=E + 1)[:E]  # (E,) kept per expert
        kept = order if self.capacity_factor is None else order[: int(counts.sum())]
        outputs = self.dispatch(x.reshape(B * T, C)[kept // k], counts)  # (n, C)
        per_slot = outputs.new_zeros(B * T * k, C).index_copy(0, kept, outputs)  # dropped slots stay zero
        y = (per_slot.view(B * T, k, C) * gates.reshape(B * T, k, 1).to(outputs.dtype)).sum(dim=1)
        aux = balance_loss(probs, assigned, k)
        self._last = {"tokens": B * T, "assigned": assigned.sum(dim=0).detach(), "kept": counts.detach(),
                      "aux": aux.detach()}
        y = y.view(B, T, C)
        if torch.is_grad_enabled() and aux.requires_grad and self.aux_loss_coef > 0:
            y = AddAuxGradient.apply(y, aux, self.aux_loss_coef * self.aux_grad_scale)
        return y

    def routing_stats(self) -> dict[str, Any]:
        """What the last forward did, as plain numbers (empty before the first forward):
        ``tokens``, ``assigned_per_expert`` (E ints, before dropping: they sum to tokens * top_k),
        ``kept_per_expert`` (E ints), ``dropped`` and ``aux_loss`` (the balance loss, unweighted)."""
        if self._last is None:
            return {}
        assigned, kept = self._last["assigned"].tolist(), self._last["kept"].tolist()
        return {"tokens": self._last["tokens"], "assigned_per_expert": assigned, "kept_per_expert": kept,
                "dropped": sum(assigned) - sum(kept), "aux_loss": float(self._last["aux"])}


def scale_aux_gradient(model: nn.Module, scale: float) -> None:
    """Scale every MoE's aux gradient in ``model`` by ``scale``: 1/m where the loss of each of m
    micro-batches is divided by m, as the cross-entropy's gradient is."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_grad_scale = scale


def refuse_sequence_parallel(experts: int, sequence_parallel: bool) -> None:
    """ConfigError [moe-sp] when a model with experts is asked for sequence parallel (not built)."""
    problems = config_rules.moe_layout_problems(experts, sequence_parallel)
    if problems:
        raise config_rules.ConfigError(problems)


if __name__ == "__main__":
    torch.manual_seed(0)
    moe = MoE(16, 32, experts=4, top_k=2, capacity_factor=1.0)
    for module in (moe.router, moe.experts):
        for p in module.parameters():
            nn.init.normal_(p, std=0.02)
    y = moe(torch.randn(2, 8, 16))
    print(tuple(y.shape), moe.routing_stats())
