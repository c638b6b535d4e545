"""``RoutingLog``: what every MoE layer's router did in each training step, as ``RoutingStep`` dicts.

A forward hook on each ``kernels.model.moe.MoE`` adds the layer's ``routing_stats()`` into the current step's
sums: tokens, assignments per expert before dropping, the ones kept, and the balance loss (averaged over the
step's forwards, the micro-batches). A Hugging Face mixture of experts is watched at the experts modules its
config's ep plan names (``kernels.model.own_experts``): the hook counts the ``top_k_index`` they receive (the
layer is named by the experts' parent, the MoE block, e.g. "model.layers.0.mlp"). Such a model is dropless, so
kept equals assigned; its router loss exists only when the model is asked for router logits, which the lab's
training does not ask, so its ``aux_loss`` is None (not recorded). The training loop closes each step with ``end_step(step)``, which turns
the sums into one ``kernels.contract.expert_context_records.RoutingStep`` per layer.

Activation checkpointing runs a block's forward again inside backward: that recompute routes the same tokens
the same way and is not counted (a forward inside a backward pass, ``_in_backward``), nor is what runs inside
``paused()`` (a pipeline stage's shape inference, one micro-batch torch runs through it before the first
schedule step). Tensor-parallel ranks of one replica route the same tokens, and each records them. Every run with experts
records this: the ranks of any layout (``kernels.train.run_build.RankBuild``) and the one-process reference
(``kernels.train.reference``), so the ranks' assignments summed over ranks can be held against the reference's.

Run alone (two steps of two micro-batches through a two-layer stack of MoEs)::

    python -m kernels.model.moe_routing
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from kernels.contract.expert_context_records import RoutingStep
from kernels.model.moe import MoE
from kernels.model.own_experts import expert_plan


def _in_backward() -> bool:
    """True inside a backward pass (an activation-checkpoint recompute). torch has no public call for this; the
    autograd engine's current graph task id is -1 outside backward."""
    return torch._C._current_graph_task_id() != -1


class RoutingLog:
    """Per training step and MoE layer of ``modules`` (a model, or a pipeline rank's stages), the routing summed
    over the step's forwards; ``rows`` holds the closed steps as ``RoutingStep`` dicts.

    ``ep_rank`` and ``ep`` say where this rank sits in its expert-parallel group (0 and 1 without one).
    """

    def __init__(self, modules: list[nn.Module], rank: int = 0, ep_rank: int = 0, ep: int = 1) -> None:
        self.rank, self.ep_rank, self.ep = rank, ep_rank, ep
        self.rows: list[dict[str, Any]] = []
        self._sums: dict[str, dict[str, Any]] = {}
        self._paused = False
        self._handles = [moe.register_forward_hook(self._hook(name)) for module in modules
                         for name, moe in module.named_modules() if isinstance(moe, MoE)]
        for module in modules:
            plan = expert_plan(module)
            self._handles += [experts.register_forward_hook(self._planned_hook(name.rpartition(".")[0], plan.experts),
                                                            with_kwargs=True)
                              for name, experts in plan.modules.items() if plan.why_not is None]

    @property
    def layers(self) -> int:
        """MoE layers watched (0: the model has no experts)."""
        return len(self._handles)

    def _hook(self, name: str):
        @torch.compiler.disable  # host reads of the counts: kept out of a compiled block's graph
        def add(moe: MoE, args: Any, output: Any) -> None:
            if not (self._paused or _in_backward()):
                self._add(name, moe.top_k, moe.routing_stats())
        return add

    def _planned_hook(self, layer: str, experts: int):
        @torch.compiler.disable  # host reads of the counts, as above
        def add(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._paused or _in_backward():
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # (tokens, top_k) expert ids
            assigned = torch.bincount(index.reshape(-1), minlength=experts).tolist()
            self._add(layer, index.shape[-1], {"tokens": index.shape[0], "assigned_per_expert": assigned,
                                               "kept_per_expert": assigned, "aux_loss": None})
        return add

    def _add(self, layer: str, top_k: int, stats: dict[str, Any]) -> None:
        """One forward's ``routing_stats()`` into the open step's sums (an unknown aux loss keeps the sum None)."""
        experts = len(stats["assigned_per_expert"])
        sums = self._sums.setdefault(layer, {"tokens": 0, "top_k": top_k, "forwards": 0, "aux": 0.0,
                                             "assigned": [0] * experts, "kept": [0] * experts})
        sums["tokens"] += stats["tokens"]
        sums["forwards"] += 1
        sums["aux"] = None if sums["aux"] is None or stats["aux_loss"] is None else sums["aux"] + stats["aux_loss"]
        sums["assigned"] = [a + b for a, b in zip(sums["assigned"], stats["assigned_per_expert"])]
        sums["kept"] = [a + b for a, b in zip(sums["kept"], stats["kept_per_expert"])]

    def end_step(self, step: int) -> None:
        """Close training step ``step``: one ``RoutingStep`` dict per layer that routed in it, into ``rows``."""
        for layer, s in self._sums.items():
            self.rows.append(RoutingStep(rank=self.rank, step=step, layer=layer, tokens=s["tokens"], top_k=s["top_k"],
                                         assigned=tuple(s["assigned"]), kept=tuple(s["kept"]),
                                         aux_loss=None if s["aux"] is None else s["aux"] / s["forwards"],
                                         ep_rank=self.ep_rank,
                                         ep=self.ep).to_dict())
        self._sums = {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count no forward made inside."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def discard(self) -> None:
        """Forget the open step's sums: its forwards trained no step (DDP's settling forward after a resume)."""
        self._sums = {}

    def take(self) -> list[dict[str, Any]]:
        """The closed steps' rows, handed over and forgotten (a held training returns each call's own)."""
        rows, self.rows = self.rows, []
        return rows

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


if __name__ == "__main__":
    torch.manual_seed(0)
    stack = nn.Sequential(MoE(16, 32, 4, top_k=2), MoE(16, 32, 4, top_k=2, capacity_factor=1.0))
    for p in stack.parameters():
        nn.init.normal_(p, std=0.1)
    log = RoutingLog([stack])
    for step in range(2):
        for _ in range(2):  # micro-batches
            stack(torch.randn(2, 8, 16)).sum().backward()
        log.end_step(step)
    for row in log.rows:
        print(row)
