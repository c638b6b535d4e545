"""Measured pipeline timelines: per-rank action events on clocks aligned to rank 0.

What is timed, and how (docs/design.md#bubble-ratio and
docs/design.md#timing-pipeline-actions):

- compute: each local ``PipelineStage`` instance gets wrappers on
  ``forward_one_chunk`` (F), ``backward_one_chunk(full_backward=True)`` (B, or I when
  ``full_backward=False``: the input-grad half of a zero-bubble split, Qi et al., 2024)
  and ``backward_weight_one_chunk`` (W). Every torch schedule calls these methods on
  the stage instance, so this times all seven schedules alike (Schedule1F1B has no
  profiler labels to use instead).
- p2p: the stage's ``get_{fwd,bwd}_{send,recv}_ops`` are wrapped to tag the P2POps
  they build (stage, micro-batch, peer, bytes), and ``schedules._batch_p2p`` (the
  one function every schedule posts its ops through) returns works whose ``wait()``
  is timed: a send/recv event spans the time this rank was *blocked* waiting, so
  events on one rank never overlap.
- anything else (dp all-reduce, optimizer step): ``recorder.span(kind)``.

Clocks: ``time.perf_counter`` on CPU; on CUDA, events recorded on the current stream
and resolved after the step against a reference event taken right after a
synchronize. Tracing off means ``instrument`` is never called: no wrappers, zero cost.

Clock alignment uses timestamped barrier round trips (docs/design.md#clock-alignment): every rank stamps
its entry to and exit from a series of barriers, each rank in turn arriving last;
since no rank leaves a barrier before the last has entered, the stamps bound each
rank's offset to rank 0 from both sides, and half the bound's width is the reported
uncertainty. Events are stored relative to rank 0's epoch, its exit from the last barrier.

Run alone (prints each rank's offset and uncertainty)::

    torchrun --nproc-per-node 4 -m kernels.measure.trace
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules

COMPUTE_KINDS = ("forward", "backward", "backward_weight")
_P2P_GETTERS = {"get_fwd_send_ops": "send", "get_bwd_send_ops": "send",
                "get_fwd_recv_ops": "recv", "get_bwd_recv_ops": "recv"}
_TAG = "_lab_trace_tag"  # attribute set on tagged P2POp objects


class _CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self, mark: float) -> float:
        return mark


class _CudaClock:
    """CUDA events on the current stream, turned into perf_counter seconds after the step."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)  # the reference fires now, not after queued work
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record()
        self._ref_cpu = time.perf_counter()

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, mark: Any) -> float:
        return self._ref_cpu + self._ref.elapsed_time(mark) / 1e3  # elapsed_time is in ms


class TraceRecorder:
    """Collects one rank's events as (start mark, end mark, fields) until ``events``."""

    def __init__(self, rank: int, device: torch.device | str = "cpu", *, cpu_clock: bool = False) -> None:
        self.rank, self.device, self.step = rank, torch.device(device), 0
        use_cuda = self.device.type == "cuda" and not cpu_clock
        self.clock = _CudaClock(self.device) if use_cuda else _CpuClock()
        self._raw: list[tuple[Any, Any, dict]] = []
        self.sampler: Any = None  # a kernels.measure.memory_timeline.MemorySampler: memory after each compute action

    def add(self, start: Any, end: Any, kind: str, stage: int | None = None,
            microbatch: int | None = None, **extra: Any) -> None:
        self._raw.append((start, end, {"kind": kind, "stage": stage, "microbatch": microbatch,
                                       "step": self.step, **extra}))

    @contextlib.contextmanager
    def span(self, kind: str, stage: int | None = None, microbatch: int | None = None,
             **extra: Any) -> Iterator[None]:
        """Time the body as one event, e.g. ``with rec.span("all_reduce", nbytes=n):``."""
        start = self.clock.mark()
        try:
            yield
        finally:
            self.add(start, self.clock.mark(), kind, stage, microbatch, **extra)

    def events(self, clock_sync: dict | None = None) -> list[dict]:
        """Plain event dicts in seconds since rank 0's epoch (local clock if no sync given)."""
        if isinstance(self.clock, _CudaClock):
            torch.cuda.synchronize(self.device)  # every recorded event has fired
        sync = clock_sync or {"offset": 0.0, "epoch": 0.0}
        shift = sync["offset"] + sync["epoch"]  # rank-0 time = local - offset; then minus epoch
        out = []
        for start, end, fields in self._raw:
            t0, t1 = self.clock.resolve(start) - shift, self.clock.resolve(end) - shift
            out.append({"rank": self.rank, **fields, "start": t0, "end": t1})
        return sorted(out, key=lambda e: (e["start"], e["end"]))


# --- instrumentation ------------------------------------------------------------------------
def _timed_compute(fn: Callable, rec: TraceRecorder, stage: int, kind: str,
                   synthetic: Any | None) -> Callable:
    """Wrap one stage method: an event per call, padded to the synthetic target if given."""
    @functools.wraps(fn)
    def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        action = {"forward": "F", "backward_weight": "W"}.get(kind)
        if action is None:  # backward: full (B) unless full_backward=False (I)
            action = "B" if kwargs.get("full_backward", args[1] if len(args) > 1 else True) else "I"
        cpu_start = time.perf_counter()
        start = rec.clock.mark()
        out = fn(chunk_id, *args, **kwargs)
        if rec.sampler is not None:  # before the pad, so a synthetic box keeps its length
            rec.sampler.sample(kind, stage, chunk_id, action)
        if synthetic is not None:
            synthetic.pad(cpu_start, action)
        rec.add(start, rec.clock.mark(), kind, stage, chunk_id, action=action)
        return out
    return wrapper


def _tagging(fn: Callable, stage: int, kind: str) -> Callable:
    """Wrap a ``get_*_ops`` method so each P2POp it builds says which event it belongs to."""
    @functools.wraps(fn)
    def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> list:
        ops = fn(chunk_id, *args, **kwargs)
        for op in ops:
            nbytes = op.tensor.numel() * op.tensor.element_size()
            setattr(op, _TAG, {"kind": kind, "stage": stage, "microbatch": chunk_id,
                               "peer": op.peer, "nbytes": nbytes})
        return ops
    return wrapper


class _TimedWork:
    """A ``dist.Work`` whose first ``wait()`` becomes one event per P2POp it covers."""

    def __init__(self, work: Any, tags: list[dict], rec: TraceRecorder) -> None:
        self._work, self._tags, self._rec = work, tags, rec

    def wait(self, *args: Any) -> Any:
        start = self._rec.clock.mark()
        out = self._work.wait(*args)
        end = self._rec.clock.mark()
        for tag in self._tags:
            self._rec.add(start, end, **tag)
        self._tags = []  # a second wait is not a second transfer
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _timed_batch_p2p(orig: Callable, rec: TraceRecorder) -> Callable:
    @functools.wraps(orig)
    def batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        works = orig(p2p_ops, desc)
        tags = [getattr(op, _TAG) for op in p2p_ops if hasattr(op, _TAG)]
        if not tags:
            return works
        if len(works) == len(p2p_ops):  # one work per op (gloo, or a homogeneous batch)
            return [_TimedWork(w, [getattr(op, _TAG)] if hasattr(op, _TAG) else [], rec)
                    for w, op in zip(works, p2p_ops)]
        return [_TimedWork(w, tags if i == 0 else [], rec) for i, w in enumerate(works)]  # coalesced
    return batch_p2p


def instrument(stages: list, rec: TraceRecorder, synthetic: Any | None = None) -> Callable[[], None]:
    """Install the wrappers on these stage instances (and the p2p hook); returns ``uninstall``.

    ``synthetic`` is a ``kernels.measure.synthetic.SyntheticCost`` or None (real compute).
    """
    if getattr(_schedules._batch_p2p, "__wrapped__", None) is not None:
        raise RuntimeError("a pipeline is already instrumented in this process")
    for stage in stages:
        sid = stage.stage_index
        for name, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                           ("backward_weight_one_chunk", "backward_weight")):
            setattr(stage, name, _timed_compute(getattr(stage, name), rec, sid, kind, synthetic))
        for name, kind in _P2P_GETTERS.items():
            setattr(stage, name, _tagging(getattr(stage, name), sid, kind))
    original = _schedules._batch_p2p
    _schedules._batch_p2p = _timed_batch_p2p(original, rec)

    def uninstall() -> None:
        _schedules._batch_p2p = original
        for stage in stages:  # instance attributes shadowed the class methods; drop them
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                         *_P2P_GETTERS):
                stage.__dict__.pop(name, None)
    return uninstall


def is_instrumented(stage: Any) -> bool:
    """True when this stage instance carries our wrappers (tracing is on for it)."""
    return any(name in vars(stage) for name in ("forward_one_chunk", *_P2P_GETTERS))


@contextlib.contextmanager
def traced(stages: list, rec: TraceRecorder, synthetic: Any | None = None) -> Iterator[TraceRecorder]:
    """``with traced(runtime.stages, rec): pipeline_step(...)``: wrappers only inside the block."""
    uninstall = instrument(stages, rec, synthetic)
    try:
        yield rec
    finally:
        uninstall()


# --- clock alignment ------------------------------------------------------------------------
_ARRIVE_LAST_S = 1e-3  # how long the designated rank waits, so that it enters the barrier last


def _offset_bounds(mine: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Interval that holds (this rank's clock minus rank 0's), from both ranks' (enter, exit) stamps.

    A barrier releases no rank before the last one has entered, so one instant R of
    every round lies inside every rank's [enter, exit]. Read on both clocks, that
    bounds the offset to [enter_mine - exit_ref, exit_mine - enter_ref] per round;
    the rounds' intersection is what holds.
    """
    low = float((mine[:, 0] - ref[:, 1]).max())
    high = float((mine[:, 1] - ref[:, 0]).min())
    return low, high


def align_clocks(rounds: int = 4, device: torch.device | str = "cpu") -> dict:
    """Every rank of the default group: this rank's offset to rank 0 and rank 0's epoch.

    Timestamped barrier round trips (docs/design.md#clock-alignment): ``rounds`` sweeps in
    which each rank in turn enters the barrier last. The round where this rank is last
    pins the offset from below (it entered just before the release that rank 0 left
    just after), the round where rank 0 is last pins it from above, and the offset is
    the middle of that interval, exact to within half its width (the uncertainty).

    Returns ``{rank, offset, uncertainty, rtt, rounds, epoch}`` in seconds: ``rtt`` is
    the interval's width, local time minus ``offset`` is rank 0's time, and ``epoch``
    is rank 0's time at the end of the sync (its exit from the last barrier).
    """
    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    stamps = torch.zeros(rounds * world, 2, dtype=torch.float64)
    dist.barrier()
    for i in range(rounds * world):
        if i % world == rank:
            time.sleep(_ARRIVE_LAST_S)
        enter = time.perf_counter()
        dist.barrier()
        stamps[i, 0], stamps[i, 1] = enter, time.perf_counter()
    ref = stamps.to(device, copy=True)  # on CPU, .to() alone would hand back stamps itself
    dist.broadcast(ref, 0)  # rank 0's stamps: each rank bounds its own offset against them
    low, high = _offset_bounds(stamps, ref.cpu()) if rank else (0.0, 0.0)  # rank 0 is the reference
    return {"rank": rank, "offset": (low + high) / 2, "uncertainty": (high - low) / 2, "rtt": high - low,
            "rounds": rounds, "epoch": float(ref[-1, 1])}  # rank 0 leaving the last barrier


def _main() -> None:
    dist.init_process_group("gloo")
    sync = align_clocks()
    print(f"[rank {sync['rank']}] offset {sync['offset'] * 1e6:+.1f} us "
          f"± {sync['uncertainty'] * 1e6:.1f} us (bound width {sync['rtt'] * 1e6:.1f} us)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
