"""The most parameters and gradients a pipeline rank holds at once over a schedule step.

A pipeline stage's model states change shape inside the step, where one model's do not:
torch's schedule keeps an FSDP2 unit whole from a backward that is not the step's last
(``set_reshard_after_backward(False)``) and keeps its gradient whole until the last backward
reduce-scatters it (``set_requires_gradient_sync(False)``), so a ZeRO-2 or ZeRO-3 stage holds
whole parameters and a whole gradient beside its shards for most of the step. At rest it
holds shards again. ``most_held`` takes ``kernels.measure.memory.model_state_bytes`` after
every forward and backward action of the rank's stages and keeps each category's largest
figure: the moments the schedule changes them. The samples cost about 5 µs per tensor held,
so only a measured step takes them.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from kernels.measure.memory import model_state_bytes

ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
CATEGORIES = ("params", "grads")


@contextlib.contextmanager
def most_held(stages: list, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[dict[str, int]]:
    """In the body, wrap each action of ``stages`` (torch ``PipelineStage`` instances) to sample ``model``'s
    states after it; the yielded dict holds each category's largest sample once the body is done (empty if
    no action ran). ``model`` holds the stages' modules, ``optimizer`` their parameters."""
    held: dict[str, int] = {}

    def sample() -> None:
        states = model_state_bytes(model, optimizer)
        for category in CATEGORIES:
            held[category] = max(held.get(category, 0), states[category])

    def sampling(action: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(action)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = action(*args, **kwargs)
            sample()
            return out
        return wrapped

    before = [{name: stage.__dict__.get(name) for name in ACTIONS} for stage in stages]  # tracing's own wrappers
    for stage in stages:
        for name in ACTIONS:
            setattr(stage, name, sampling(getattr(stage, name)))
    try:
        yield held
    finally:
        for stage, kept in zip(stages, before):
            for name, action in kept.items():
                if action is None:
                    stage.__dict__.pop(name, None)
                else:
                    setattr(stage, name, action)
