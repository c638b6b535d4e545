"""What one training run measured, as plain data that can be saved and replayed without ranks.

The views (``timeline``, ``memory``, ``comm``, ``sharding`` and the ``plot_*`` figures)
are pure functions of these fields, so a ``RunResult`` read back from JSON shows
exactly what the live one showed (docs/design.md#records-and-views).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernels.contract.expert_context_records import RingStep, RoutingStep
from kernels.contract.stragglers import stragglers, typical_per_rank
from kernels.contract.measure_records import Throughput
from lab.measure import timeline as _timeline
from lab.measure.comm_prediction import comm_records
from lab.run.comm_table import CommTable
from lab.measure.memory_and_comm import memory_records
from lab.measure.throughput import run_throughput


class NotRecordedError(ValueError):
    """A view needs data this run did not record (say which Experiment option records it)."""


@dataclass(frozen=True)
class RunResult:
    """Per-step losses, per-rank step times and the layout each rank actually built.

    ``layout[r]`` is rank r's own description: its mesh coordinates, the strategy,
    and for every parameter it holds the global and local shapes and placements.
    ``params`` (only when asked for) maps rank -> {name: nested lists}. The measured
    fields are empty unless the Experiment asked for them (``trace``, ``measure``).
    """

    config: dict[str, Any]  # the run config the ranks received (model, layout, training)
    losses: list[float]  # global-batch mean loss per optimizer step
    step_times: list[list[float]]  # [rank][step] seconds
    layout: list[dict[str, Any]]  # [rank] layout record
    grad_norms: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    params: dict[int, dict[str, Any]] = field(default_factory=dict)
    # trace=True (pp > 1): the last step, on clocks aligned to rank 0
    events: list[dict[str, Any]] = field(default_factory=list)  # TraceEvent dicts of every rank, seconds
    clock: list[dict[str, Any]] = field(default_factory=list)  # [rank] ClockSync dict: offset, uncertainty
    planned: list[list[list]] = field(default_factory=list)  # [rank] [[stage, "F"|"B"|"I"|"W", micro-batch]]
    bubble: dict[str, Any] = field(default_factory=dict)  # BubbleReport dict: measured idle beside theory
    # measure=True: the last step's memory and collectives, each beside its prediction
    # (named *_records: ``memory()`` and ``comm()`` are the views)
    memory_records: list[dict[str, Any]] = field(default_factory=list)  # MemoryRecord dicts
    comm_records: list[dict[str, Any]] = field(default_factory=list)  # CommRecord dicts
    # live progress (Experiment.start / run): StepProgress dicts, and the last step of a stopped run
    progress: list[dict[str, Any]] = field(default_factory=list)
    stopped_at: int | None = None
    first_step: int = 0  # steps done before this run (resumed from a checkpoint at that step)

    @classmethod
    def from_ranks(cls, per_rank: list[dict[str, Any]], cfg: dict[str, Any], *, hosts: list[str] | None = None,
                   warnings: list[str] | tuple[str, ...] = (), return_params: bool = False) -> "RunResult":
        """The result of a run from what each rank returned (``kernels.train.entry.train_rank``'s records).

        ``hosts`` (rank -> host name) lets the comm rows say which bytes crossed hosts;
        ``warnings`` are the driver's own, put before those the records give.
        """
        found = measured_fields(per_rank, cfg, hosts)
        return cls(
            config=cfg, losses=list(per_rank[0]["losses"]), grad_norms=list(per_rank[0].get("grad_norms", [])),
            step_times=[list(r["step_times"]) for r in per_rank], layout=[r["layout"] for r in per_rank],
            warnings=list(warnings) + found.pop("warnings"),
            params={rank: r["params"] for rank, r in enumerate(per_rank)} if return_params else {},
            first_step=per_rank[0].get("first_step", 0),
            step_waits=[w for r in per_rank for w in r.get("waits", [])], faults=list(cfg.get("faults", [])),
            ring_records=[s for r in per_rank for s in r.get("ring_steps", [])],
            routing_records=[s for r in per_rank for s in r.get("routing_steps", [])],
            lrs=list(per_rank[0].get("lrs", [])), spikes=list(per_rank[0].get("spikes", [])), **found)

    @property
    def steps_ran(self) -> list[int]:
        """The steps this run trained, counted from 1 over the whole training: [4, 5, 6] after a resume at 3."""
        return list(range(self.first_step + 1, self.first_step + len(self.losses) + 1))
    # every run (kernels.watch.rank_watch): per rank and step, time in collectives against the rest
    step_waits: list[dict[str, Any]] = field(default_factory=list)  # kernels.watch.collective_log.StepWait dicts
    faults: list[dict[str, Any]] = field(default_factory=list)  # lab.Slow/Hang/Crash/Kill injected, as dicts
    # trace=True: what each rank held after each action of the traced step (kernels.contract.measure_records.MemorySample dicts)
    memory_timeline: list[dict[str, Any]] = field(default_factory=list)
    # cp > 1: every rank's ring steps in the last step's forward (RingStep dicts; the view is ``ring_steps()``)
    ring_records: list[dict[str, Any]] = field(default_factory=list)
    # a model with experts: every rank's routing per step and MoE layer (RoutingStep dicts; the view is ``routing()``)
    routing_records: list[dict[str, Any]] = field(default_factory=list)
    # training hygiene (lab.run.training_hygiene): each step's lr, and each step a spike guard skipped
    lrs: list[float] = field(default_factory=list)
    spikes: list[dict[str, Any]] = field(default_factory=list)  # SpikeEvent dicts: step, loss, median, reason, action

    @property
    def world_size(self) -> int:
        """Ranks that took part (1 for the one-process reference)."""
        return len(self.step_times)

    def matches(self, other: "RunResult", rtol: float = 1e-4) -> bool:
        """True when every step's loss equals ``other``'s within ``rtol`` (a NaN matches a NaN: a poisoned step)."""
        return len(self.losses) == len(other.losses) and all(
            math.isclose(a, b, rel_tol=rtol) or math.isnan(a) and math.isnan(b)
            for a, b in zip(self.losses, other.losses))

    def loss_table(self, other: "RunResult | None" = None) -> str:
        """Step, loss (and the other run's loss beside it) as aligned text."""
        head = "step  loss" + ("        reference   rel. diff" if other else "")
        rows = [head]
        for step, loss in enumerate(self.losses):
            row = f"{step:>4}  {loss:.6f}"
            if other:
                ref = other.losses[step]
                row += f"    {ref:.6f}    {abs(loss - ref) / abs(ref):.1e}"
            rows.append(row)
        return "\n".join(rows)

    # --- views: records in, widgets and figures out ----------------------------------------
    def _need(self, name: str, what: str) -> None:
        if not getattr(self, name):
            option = {"events": "trace=True (a pipeline layout, pp > 1)",
                      "ring_records": "a context-parallel layout, lab.Parallel(cp=2) or more,",
                      "routing_records": "a model with experts, lab.GPT(..., experts=E),",
                      "progress": "nothing: run it with progress on (the default) or start()"}.get(name, "measure=True")
            raise NotRecordedError(f"this run recorded no {what}: pass {option} to lab.Experiment and run it again")

    def _planned(self) -> dict[int, list]:
        return {rank: acts for rank, acts in enumerate(self.planned) if acts}

    def timeline(self):
        """``widgets.PipelineTimeline`` of the traced step: lanes per rank, the bubble, the planned overlay."""
        from widgets import PipelineTimeline
        self._need("events", "trace events")
        return PipelineTimeline(self.events, self.bubble or None, self._planned())

    def plot_timeline(self):
        """The timeline as a matplotlib Figure (no widget needed)."""
        from widgets import plot_timeline
        self._need("events", "trace events")
        return plot_timeline(self.events, self.bubble or None)

    def to_chrome_trace(self, path: str | Path | None = None) -> dict:
        """Chrome/Perfetto trace JSON of the traced step, one track per rank; written to ``path`` if given."""
        self._need("events", "trace events")
        return _timeline.to_chrome_trace(self.events, path)

    def _need_memory(self) -> None:
        if not (self.memory_records or self.memory_timeline):
            raise NotRecordedError("this run recorded no memory: pass measure=True (memory by category) or "
                                   "trace=True on a pipeline layout (memory along the traced step) to lab.Experiment")

    def memory(self, moment: str = "at_rest"):
        """``widgets.MemoryView``: per rank and category, measured beside predicted and the ZeRO formula, and the
        traced step's memory over time per rank (trace=True)."""
        from widgets import MemoryView
        self._need_memory()
        return MemoryView(self.memory_records, moment, timeline=self.memory_timeline)

    def plot_memory(self, moment: str = "at_rest"):
        """The memory view at ``moment`` as a matplotlib Figure (with the over-time strip when traced)."""
        from widgets import plot_memory
        self._need_memory()
        return plot_memory(self.memory_records, moment, timeline=self.memory_timeline)

    def ring_steps(self) -> list[RingStep]:
        """Context parallelism (cp > 1): each rank's ring steps in the last step's last micro-batch forward, one
        ``RingStep`` per ring step of each attention layer: which cp rank's key/value block it attended, its compute,
        its wait for the next block and the bytes it sent on (``kernels.contract.expert_context_records``)."""
        self._need("ring_records", "ring steps")
        return [RingStep.from_dict(r) for r in self.ring_records]

    def routing(self) -> list[RoutingStep]:
        """A model with experts: each rank's routing per training step and MoE layer, summed over the step's
        micro-batches: assignments per expert before any capacity drop, those kept, the balance loss
        (``kernels.contract.expert_context_records``; the one-process reference's are all rank 0's, ep 1)."""
        self._need("routing_records", "routing")
        return [RoutingStep.from_dict(r) for r in self.routing_records]

    def expert_routing(self, step: int | None = None, layer: str | None = None):
        """``widgets.ExpertRouting`` of ``routing()``: the all-to-all matrix (rank x expert) of one step and MoE
        layer (default: the last step, the first layer), the load per expert, imbalance, drops and balance loss."""
        from widgets import ExpertRouting
        return ExpertRouting(self.routing(), step=step, layer=layer)

    def ring_timeline(self, step: int | None = None, layer: str | None = None):
        """``widgets.RingTimeline`` of ``ring_steps()``: one lane per rank, each ring step's compute beside the
        transfer of the next key/value block (default: the first attention layer)."""
        from widgets import RingTimeline
        return RingTimeline(self.ring_steps(), step=step, layer=layer)

    def comm(self) -> CommTable:
        """Per rank and collective type: count, bytes, seconds and busbw beside the analytic volume."""
        # A measured run always has memory records; its collectives may be none (a world of one rank).
        self._need("memory_records", "collectives")
        return CommTable(sorted(self.comm_records, key=lambda r: (r["rank"], r["source"], r["op"])))

    def sharding(self):
        """``widgets.ShardingView`` of the layout every rank built."""
        from widgets import ShardingView
        return ShardingView(self.layout)

    def dashboard(self, peak_flops: float | str | None = None):
        """The run's ``widgets.TrainingDashboard``, replayed from its progress records (``Experiment.run``/``start``);
        with ``peak_flops`` (one device's FLOP/s or a GPU's name, as ``throughput``) it shows MFU too."""
        from widgets import TrainingDashboard

        self._need("progress", "per-step progress")
        speed = self.throughput(peak_flops)
        return TrainingDashboard.replay(self.progress, world_size=self.world_size, steps=self.config.get("steps", 0),
                                        flops_per_token=speed.model_flops_per_step / speed.tokens_per_step,
                                        peak_flops=speed.peak_flops)

    def throughput(self, peak_flops: float | str | None = None) -> Throughput:
        """Tokens/s, model FLOPs per step, MFU against ``peak_flops`` (one device's FLOP/s, or a GPU's name such as
        "H100") or None without it, and the mean overlap of communication with compute (``lab.measure.throughput``)."""
        return run_throughput(self.config, self.step_times, self.layout, self.step_waits, peak_flops)

    def stragglers(self) -> list[int]:
        """The ranks whose own compute stands out (``kernels.contract.stragglers``), in rank order; [] if none.

        Taken from the progress records the dashboard shows (so it marks the same ranks),
        or from ``step_waits`` for a run without them. Compute is a step less its waits
        for collectives, DTensor's and a pipeline's p2p included, so a rank held up by a
        slow peer is not named beside it.
        """
        rows = self.progress or self.step_waits
        return stragglers(typical_per_rank((row["rank"], row["step"], row["compute_s"]) for row in rows))

    # --- JSON ------------------------------------------------------------------------------
    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to JSON (and write it to ``path`` if given)."""
        text = json.dumps(asdict(self))
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "RunResult":
        """Read back what ``to_json`` wrote (a JSON string or a file path)."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        data["params"] = {int(k): v for k, v in data.get("params", {}).items()}
        return cls(**data)


def measured_fields(per_rank: list[dict[str, Any]], cfg: dict[str, Any], hosts: list[str] | None = None) -> dict[str, Any]:
    """RunResult's measured fields from the rank records, as JSON-plain data (so a saved run equals a live one).

    Trace records give events, clock, planned and the bubble; measure records give memory
    and comm rows with their predictions; both may add warnings (oversubscribed
    real compute, synthetic actions whose real compute overran the target).
    """
    traces = [r["trace"] for r in per_rank if r.get("trace")]
    probes = [r["measure"] for r in per_rank if r.get("measure")]
    out: dict[str, Any] = {"events": [], "clock": [], "planned": [], "bubble": {}, "memory_records": [],
                           "comm_records": [],
                           "warnings": []}
    if traces:
        out["events"] = [e for t in traces for e in t["events"]]
        out["clock"] = [t["clock"] for t in traces]
        out["planned"] = _timeline.planned_orders(traces)
        out["bubble"] = _timeline.bubble_from_records(traces).to_dict()
        out["memory_timeline"] = [m for t in traces for m in t.get("memory", [])]  # kernels.measure.memory_timeline samples
        out["warnings"] = sorted({w for t in traces for w in t["warnings"]})
        overruns = sum((t["synthetic_cost"] or {}).get("overruns", 0) for t in traces)
        if overruns:
            out["warnings"].append(f"synthetic cost: {overruns} actions' real compute overran their target, "
                                   f"so those took longer than synthetic_forward_s implies")
    if probes:
        out["memory_records"] = [m.to_dict() for rec in probes for m in memory_records(rec)]
        out["comm_records"] = [c.to_dict() for rec in probes for c in comm_records(rec, cfg, hosts)]
    return json.loads(json.dumps(out))  # tuples become lists, as after a JSON round trip
