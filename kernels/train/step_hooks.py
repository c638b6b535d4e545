"""Where measuring attaches to the training loop: ``StepHooks``, one object the loop calls at fixed points.

Two kinds of watcher, both off by default (then every hook is a no-op and the loop
costs what it did), both on the last step only:

- a probe (``kernels.train.measured_run``): ``StepProbe`` meters each part of a step (every
  micro-batch's forward and backward, the optimizer step) and snapshots memory after
  the last forward and at rest; ``PipelineProbe`` meters the whole pipeline step;
- a tracer (``PipelineTracer``, pp > 1): after the untraced steps (the first also
  infers p2p shapes) the clocks are aligned to rank 0 (``kernels.measure.trace.align_clocks``),
  the ranks meet at a barrier, and the step runs inside ``kernels.measure.trace.traced``:
  per-stage F/B/I/W actions and p2p waits, plus spans for the dp gradient all-reduce
  and the optimizer step (GPipe: Huang et al., 2019; 1F1B: Narayanan et al., 2019).
  ``synthetic_forward_s`` pads every action to a fixed cost
  (``kernels.measure.synthetic.SyntheticCost``, v = this rank's stage count) so the bubble is
  comparable with theory (on a ``lab.Slow`` rank each cost times its factor, so the slow stage's
  busy time grows by it); real compute with more ranks on a host than cores warns. Given the
  rank's stages and optimizer, it also samples memory after each action
  (``kernels.measure.memory_timeline``; the record's ``memory``).

With context parallelism a ring log (``kernels.parallel.context_parallel.RingLog``) records the ring
steps of the last step's last micro-batch forward: a few small dicts per attention layer.

Run alone (traces a PP 4 step with synthetic costs)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --pp 4 --layers 4 --microbatches 8 --trace
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

from kernels.train.measured_run import PipelineProbe, StepProbe
from kernels.measure.memory_timeline import MemorySampler
from kernels.parallel.context_parallel import RingLog
from kernels.parallel.pipeline import PipelineRuntime, planned_compute_order
from kernels.contract.run_config import RunConfig
from kernels.measure.synthetic import SyntheticCost, oversubscription_warning
from kernels.measure.trace import TraceRecorder, align_clocks, traced
from kernels.watch.faults import faults_for, pacing_for


class PipelineTracer:
    """The last step's recorder, synthetic cost and clock sync; ``record`` is the plain trace record."""

    def __init__(self, run: RunConfig, runtime: PipelineRuntime, device: torch.device,
                 model: torch.nn.Module | None = None, optimizer: Any = None) -> None:
        self.runtime, self.device, self.rounds = runtime, device, run.align_rounds
        forward_s, rank, per_host = run.synthetic_forward_s, dist.get_rank(), run.ranks_per_host
        slow = pacing_for(faults_for(run.faults, rank), None).factor  # a lab.Slow rank's actions take f x their cost
        self.synthetic = SyntheticCost(float(forward_s), len(runtime.stage_ids), slow) if forward_s else None
        if (run.world_size or dist.get_world_size()) != dist.get_world_size():
            raise ValueError("trace aligns clocks over every rank of the process group: run on all of them")
        here = per_host[rank] if per_host else int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.warning = oversubscription_warning(here, self.synthetic is not None)
        # Synthetic actions sleep on the CPU clock, so their events are timed on it too.
        self.rec = TraceRecorder(rank, device, cpu_clock=self.synthetic is not None)
        self.sync: dict | None = None
        if model is not None:  # memory along the step (kernels.measure.memory_timeline); compiled code keeps its own saves
            self.rec.sampler = None if run.strategy.compile else MemorySampler(model, optimizer, device, self.rec.clock, rank)

    def begin(self, step: int) -> None:
        """Align the clocks (every rank of the default group), then start the step together."""
        self.sync = align_clocks(self.rounds, self.device)
        self.rec.step = step
        dist.barrier()
        if self.rec.sampler is not None:
            self.rec.sampler.step = step
            self.rec.sampler.sample("start")

    def record(self, pp_rank: int, dp_rank: int, dp: int, pp: int) -> dict[str, Any]:
        r = self.runtime
        return {"rank": dist.get_rank(), "pp_rank": pp_rank, "dp_rank": dp_rank, "schedule": r.schedule_name, "pp": pp,
                "dp": dp, "stages_per_rank": len(r.stage_ids), "microbatches": r.num_microbatches,
                "stage_ids": list(r.stage_ids), "num_stages": r.num_stages, "device": str(self.device),
                "synthetic": self.synthetic is not None,
                "synthetic_cost": self.synthetic.summary() if self.synthetic else None,
                "events": self.rec.events(self.sync), "clock": self.sync,
                "planned": planned_compute_order(r, pp_rank), "warnings": [self.warning] if self.warning else [],
                "memory": self.rec.sampler.records(self.sync) if self.rec.sampler is not None else []}


class StepHooks:
    """The loop's calls into the probe and the tracer; each acts on the last step only."""

    def __init__(self, steps: int, probe: StepProbe | None = None, tracer: PipelineTracer | None = None,
                 ring: RingLog | None = None) -> None:
        self.last_step, self.probe, self.tracer = steps - 1, probe, tracer
        self.ring = ring  # context parallelism: records the ring steps of the last micro-batch's forward
        self.step = -1

    @property
    def keeps_gradients(self) -> bool:
        """Probing: gradients are zeroed in place, so their buffers exist at the peak (ZeRO formulas)."""
        return self.probe is not None

    def _watching(self) -> bool:
        return self.step == self.last_step

    def begin(self, step: int) -> None:
        """Before the step's clock starts: the tracer aligns clocks and meets the other ranks."""
        self.step = step
        if self.tracer is not None and self._watching():
            self.tracer.begin(step)

    def whole_step(self) -> contextlib.AbstractContextManager:
        """Around the whole step: a pipeline probe meters it in one session."""
        return self.probe.step() if isinstance(self.probe, PipelineProbe) and self._watching() \
            else contextlib.nullcontext()

    @contextlib.contextmanager
    def part(self, kind: str | None = None, **extra: Any):
        """Around one part of a step (a micro-batch, the gradient all-reduce, the optimizer step)."""
        with contextlib.ExitStack() as stack:
            if self._watching():
                if self.probe is not None and not isinstance(self.probe, PipelineProbe):
                    stack.enter_context(self.probe.metered())
                if self.tracer is not None and kind is not None:
                    stack.enter_context(self.tracer.rec.span(kind, **extra))
            yield
        if self._watching() and self.tracer is not None and kind is not None and self.tracer.rec.sampler is not None:
            self.tracer.rec.sampler.sample(kind)

    def forward(self, last_micro: bool) -> contextlib.AbstractContextManager:
        """Around the last micro-batch's forward: the probe counts saved activations, then snapshots memory;
        a ring log records the ring steps."""
        stack = contextlib.ExitStack()
        if last_micro and self._watching():
            if self.probe is not None and not isinstance(self.probe, PipelineProbe):
                stack.enter_context(self.probe.forward())
            if self.ring is not None:
                stack.enter_context(self.ring.recording(self.step))
        return stack

    def schedule(self, stages: list) -> contextlib.AbstractContextManager:
        """Around a pipeline schedule's step: the tracer instruments its stages."""
        if self.tracer is None or not self._watching():
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if self.tracer.rec.sampler is not None:  # saved tensors are counted while alive (kernels.measure.memory_timeline)
            stack.enter_context(self.tracer.rec.sampler.live.counting())
        stack.enter_context(traced(stages, self.tracer.rec, self.tracer.synthetic))
        return stack

    def at_rest(self) -> None:
        """After the optimizer step, before zero_grad."""
        if self.probe is not None and self._watching():
            self.probe.at_rest()
