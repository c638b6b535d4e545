"""Which part of the model saved each activation: attention, MLP, norms, the output projection, the loss.

The breakdown the sizing guides give for activation memory (the Ultra-Scale Playbook's memory
section; Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4.1) splits a layer's saved tensors by the sub-module that saved them. Here the
split is measured: ``PartTracker`` keeps a stack of the model's modules that are running
(forward pre/post hooks on this model's own modules only, removed on exit, so nothing global
is left behind), and a saved tensor belongs to the innermost module that names a part.

- ``attention``: an attention module (GPT's CausalSelfAttention, Llama's Attention), its
  q/k/v/out projections included; ``mlp``: the MLP (GELU or SwiGLU), both linears included;
  ``norms``: LayerNorm / RMSNorm; ``projection``: ``lm_head`` (hidden -> vocab logits);
  ``embeddings``: token and position embeddings; ``cross-entropy``: saved outside the model,
  which in the training step is only the loss (log-softmax of the logits and the targets);
  ``other``: inside the model but in none of these (a block's own code).

A storage saved by two parts is counted once, for the first part that saved it (so the
parts sum to ``SavedActivations.bytes``).
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

PARTS = ("attention", "mlp", "norms", "projection", "embeddings", "cross-entropy", "other")


def part_of(name: str, module: nn.Module) -> str | None:
    """The part a module stands for, or None for containers (blocks, the model). FSDP2 renames a wrapped
    module's class to ``FSDP<Name>``, so names are matched by their ending."""
    cls = type(module).__name__
    if cls.endswith("Attention"):
        return "attention"
    if cls.endswith("MLP"):
        return "mlp"
    if cls.endswith("Norm"):
        return "norms"
    if name.split(".")[-1] == "lm_head":
        return "projection"
    if cls.endswith("Embedding"):
        return "embeddings"
    return None


class PartTracker:
    """Context manager: ``current()`` is the part of the innermost running module of ``model`` that names one,
    ``"cross-entropy"`` outside the model, ``"other"`` inside it but in no named part."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str | None] = []
        self._handles: list[Any] = []

    def current(self) -> str:
        if not self.stack:
            return "cross-entropy"
        return next((p for p in reversed(self.stack) if p is not None), "other")

    def _enter(self, part: str | None) -> Any:
        def hook(*_: Any) -> None:  # a hook's return value would replace the module's input
            self.stack.append(part)
        return hook

    def _leave(self, *_: Any) -> None:  # returns None: a value would replace the module's output
        if self.stack:
            self.stack.pop()

    def __enter__(self) -> "PartTracker":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(part_of(name, module))))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()
