"""The probes that measure memory and communication of a layout's step (``kernels.train.entry.measure_rank``).

Algorithm: the layout is built and trained exactly as ``kernels.train.entry.train_rank``
builds and trains it (TP -> activation checkpointing -> FSDP2/DDP/ZeRO-1,
Rajbhandari et al., 2020; Zhao et al., 2023); the probes of ``kernels.measure.memory`` and
``kernels.watch.comm`` watch its last step (the steady state: optimizer state exists and
DDP has rebuilt its buckets). ``kernels.train.entry.measure_rank`` is ``train_rank`` with
``cfg["measure"]`` on; the probes are the ``StepProbe``/``PipelineProbe`` below,
which the training loop calls at fixed points of the step (``kernels.train.step_hooks``):

- memory at ``peak_fwd_bwd`` (the last micro-batch's forward done, loss in hand,
  backward not started) and ``at_rest`` (after ``optimizer.step()``, before
  ``zero_grad``); while probing, gradients are zeroed with ``set_to_none=False`` so
  their buffers live across steps, as in the ZeRO formulas;
- communication over the whole step (forward, backward, optimizer step), per
  collective type; the loss report and the gradient norm come after, unmetered. DDP
  is switched to torch's Python ``allreduce_hook`` so its bucket all-reduces are
  seen (same maths as its C++ default).

With pp > 1 (``PipelineProbe``) a whole schedule step runs (m micro-batches) and
only the ``at_rest`` moment is taken: forward and backward interleave inside the
schedule, so there is no single moment between them. Instead the most activations
held at once over the step are kept, by part (``activations_held``,
``kernels.measure.activation_peak``), and the most parameter and gradient bytes, sampled
after each stage action (``model_states_held``, ``kernels.measure.model_states_peak``).
Stage-boundary p2p is metered at the stage (``PipelineStage.get_{fwd,bwd}_send_ops``, the tensors each send carries):
torch's ``P2POp`` rejects a wrapped ``dist.isend``, so the namespace patch leaves p2p
alone here (``_CollectiveMeter``). Config keys are ``kernels.contract.run_config.RunConfig``'s;
``steps`` defaults to 2 here.

Record: ``{"rank", "coords", "strategy", "zero", "hybrid", "dims": {dp (the data axis: dp·cp), tp, pp, dp_replicate, ep, cp},
"params": describe_params, "optimizer_params": [names] (ZeRO-1 only), "memory":
{"peak_fwd_bwd": snapshot, "at_rest": snapshot}, "comm": [CommMeter rows],
"comm_debug_counts": {CommDebugMode op: count}, "comm_unmetered": {op: count},
"step_seconds", "loss", "device", "microbatches", "optimizer"}``; with pp also ``"stage_ids",
"num_stages", "micro_batch", "activations_held", "model_states_held"`` (memory: ``at_rest`` only; the most held
over the step are the two ``*_held``).

Run alone through the rank entry point (ZeRO-3 on 4 ranks, prints rank 0's memory and comm)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 4 --zero 3 --measure
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.watch.comm import CommMeter, route_ddp_through_python, unmetered
from kernels.watch.dist_names import DIST_OPS, P2P
from kernels.measure.activation_peak import PeakActivations
from kernels.measure.memory import SavedActivations, snapshot
from kernels.measure.model_states_peak import most_held


class StepProbe:
    """The probes of one training step; the loop calls ``metered()``, ``forward()`` and ``at_rest()``.

    ``model`` is what the loop runs (DDP wrapper included); ``optimizer`` its optimizer.
    """

    def __init__(self, model: nn.Module, optimizer, device: torch.device, meter: CommMeter | None = None) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.meter = meter if meter is not None else CommMeter()
        self.memory: dict[str, dict[str, Any]] = {}
        self.seconds: float | None = None  # summed over the metered parts of the step
        self.debug_counts: dict[str, int] = {}

    @contextlib.contextmanager
    def metered(self) -> Iterator[None]:
        """Meter every collective of the body (a micro-batch's forward and backward, or the optimizer step).

        One meter session per call, summed over the calls.
        """
        if self.seconds is None:
            self.seconds = 0.0
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # the peak of this step only
        start = time.perf_counter()
        with self.meter.active():
            yield
        self.seconds += time.perf_counter() - start
        for op, n in getattr(self.meter, "debug_counts", {}).items():
            self.debug_counts[op] = self.debug_counts.get(op, 0) + n

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Count what autograd saves in the body; snapshot ``peak_fwd_bwd`` right after it."""
        with SavedActivations(self.model) as acts:
            yield
        self.memory["peak_fwd_bwd"] = snapshot(self.model, self.optimizer, "peak_fwd_bwd", acts.bytes, self.device,
                                               acts.parts)

    def at_rest(self) -> None:
        """Snapshot ``at_rest``: call after ``optimizer.step()``, before ``zero_grad``."""
        self.memory["at_rest"] = snapshot(self.model, self.optimizer, "at_rest", None, self.device)

    def rows(self) -> dict[str, Any]:
        """The measured part of the record (memory, comm rows, the meter's checks, step seconds)."""
        rows = self.meter.rows
        return {"memory": dict(self.memory), "comm": rows, "comm_debug_counts": dict(self.debug_counts),
                "comm_unmetered": unmetered(self.debug_counts, rows), "step_seconds": self.seconds}


class _CollectiveMeter(CommMeter):
    """A CommMeter for pipeline steps: ``torch.distributed`` collectives and TP's functional ones.

    p2p is left unpatched: ``P2POp`` checks ``op`` by identity against the unwrapped
    ``isend``/``irecv``, so a wrapped one breaks the pipeline's sends (they are counted
    at the stage instead, ``meter_stage_sends``).
    """

    def _dist_names(self) -> list[str]:
        return [n for n in DIST_OPS if n not in P2P and hasattr(dist, n)]


@contextlib.contextmanager
def meter_stage_sends(stages: list, meter: CommMeter) -> Iterator[None]:
    """Count every stage-boundary send of ``stages`` into ``meter`` (op "send", group size 2) in the body.

    Wraps each instance's ``get_fwd_send_ops`` (activations to the next stage) and
    ``get_bwd_send_ops`` (input gradients to the previous one): the payload is each
    op's tensor, (b, T, C) here. Time is not known at that point and is left 0. The
    wrappers are instance attributes, dropped again on exit.
    """
    def counting(original: Any) -> Any:
        def wrapped(chunk_id: int, *args: Any, **kwargs: Any) -> list:
            ops = original(chunk_id, *args, **kwargs)
            for op in ops:
                meter.record("send", 2, op.tensor.numel() * op.tensor.element_size(), 0.0, "pipeline", op.peer)
            return ops
        return wrapped

    names = ("get_fwd_send_ops", "get_bwd_send_ops")
    for stage in stages:
        for name in names:
            setattr(stage, name, counting(getattr(stage, name)))
    try:
        yield
    finally:
        for stage in stages:
            for name in names:
                stage.__dict__.pop(name, None)


class PipelineProbe(StepProbe):
    """pp > 1: this rank's stages (``model`` = their ModuleList); at rest, and the most held at once over the
    schedule step; p2p counted at the stages."""

    def __init__(self, model: nn.Module, optimizer, device: torch.device, stages: list) -> None:
        super().__init__(model, optimizer, device, _CollectiveMeter())
        self.stages = stages
        self.held: dict[str, Any] | None = None  # the peak of activations held over the step, once measured
        self.states_held: dict[str, int] | None = None  # the most parameter and gradient bytes held over it

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Meter the whole schedule step, dp gradient reduction and optimizer step (one session), and keep the most
        activations held at once over it (``activations_held``, by part)."""
        peak = PeakActivations(self.model)
        with meter_stage_sends(self.stages, self.meter), self.metered(), peak.counting(), \
                most_held(self.stages, self.model, self.optimizer) as states:
            yield
        self.held = {"activations": peak.peak, "activation_parts": peak.peak_parts}
        self.states_held = dict(states)

    def rows(self) -> dict[str, Any]:
        """The measured part of the record, with the most activations, parameters and gradients held at once over
        the schedule step."""
        return {**super().rows(), "activations_held": self.held, "model_states_held": self.states_held}


def step_probe(model: nn.Module, optimizer, device: torch.device) -> StepProbe:
    """A StepProbe of ``model`` (a DDP model is rerouted first, so its buckets are seen)."""
    if isinstance(model, DDP):
        route_ddp_through_python(model)  # before the first backward
    return StepProbe(model, optimizer, device)


def measure_record(layout: dict[str, Any], dims: Any, device: torch.device, probe: StepProbe,
                   **extra: Any) -> dict[str, Any]:
    """The record (module docstring): this rank's layout record, the mesh sizes and what ``probe`` measured."""
    # "dp" is the data axis (dp·cp ranks): the ranks ZeRO/FSDP shard over and gradients meet on.
    return {**layout, "dims": {"dp": dims.data, "tp": dims.tp, "pp": dims.pp, "dp_replicate": dims.dp_replicate,
                               "ep": dims.ep, "cp": dims.cp}, "device": str(device),
            **extra, **probe.rows()}
