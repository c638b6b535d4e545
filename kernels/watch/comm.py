"""What one rank communicates in a step: count, payload bytes and time per collective type.

Algorithm: call-site metering of collectives, counted as nccl-tests counts them
(NVIDIA nccl-tests, doc/PERFORMANCE.md): the *payload* of a call is the tensor it
works on (all_reduce: the tensor; all_gather: the whole gathered output;
reduce_scatter: the whole input; broadcast/send/recv: the tensor). The driver turns
payload and time into algbw = payload / time and busbw = algbw * f (docs/design.md#bus-bandwidth,
``lab.planning.plan_math.busbw_factor``); payload * f is also the bytes a ring sends per rank.

Three ways in, one meter (``CommMeter``):

- ``torch.distributed`` calls (FSDP2's ``all_gather_single``/``reduce_scatter_single``,
  ZeroRedundancyOptimizer's ``broadcast``, pipelining's ``batch_isend_irecv``): while
  ``meter.patch_dist()`` is active the functions in the ``torch.distributed``
  namespace are wrapped. Only the outermost call is counted. An async collective is
  waited for at once, so its time is the collective's own (this serialises FSDP2's
  overlap: it is a measuring mode); p2p ops are timed to their post only (waiting
  there could deadlock a send/recv pair).
- DDP: its C++ reducer all-reduces buckets without Python; ``route_ddp_through_python`` registers
  torch's stock ``allreduce_hook`` (divide by n, all_reduce SUM: the same maths), which calls
  ``dist.all_reduce`` on each flat bucket, so the patch sees it.
- DTensor (TP) functional collectives (``_c10d_functional.*``): ``FuncolMeter``, a
  ``torch.distributed.tensor.debug.CommDebugMode`` that also records the payload and
  time of each functional collective (CommDebugMode itself only counts them). Its
  per-module tracker is left out (``_NoModuleTracker``): it fails inside pipeline stage
  calls and its hooks kept the step's modules alive.

Rows (``CommMeter.rows``), one per (op, group size, source): ``{"op", "group_size", "count",
"payload_bytes", "seconds", "source", "to"}``; source is "dist" or "funcol", "to" the payload by
the global rank it goes to, as a ring counts it (a collective: the next rank of its group; a
send: its peer). Bandwidths and the intra/inter-host split are the driver's. After ``active()``:
``debug_counts`` (CommDebugMode's own, a check on the meter) and ``unmetered`` (what no wrapper saw).

Run alone (meters one all_reduce and one all_gather on 2 ranks)::

    torchrun --nproc-per-node 2 -m kernels.watch.comm
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from kernels.watch.dist_names import DIST_OPS, P2P, patched_dist_names, tensor_bytes


class CommMeter:
    """Accumulates (op, group size, source) -> count, payload bytes, seconds for this rank."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int, str], dict[str, Any]] = {}
        self._local = threading.local()

    def record(self, op: str, group_size: int, payload: int, seconds: float, source: str,
               to: int | None = None) -> None:
        """Add one call; ``to`` is the global rank its bytes go to (a collective's ring successor, a send's peer)."""
        row = self._rows.setdefault((op, group_size, source), {"op": op, "group_size": group_size, "count": 0,
                                                       "payload_bytes": 0, "seconds": 0.0, "source": source,
                                                       "to": {}})
        row["count"] += 1
        row["payload_bytes"] += int(payload)
        row["seconds"] += seconds
        if to is not None:  # payload by destination: the driver splits it into intra- and inter-host bytes
            row["to"][str(to)] = row["to"].get(str(to), 0) + int(payload)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [{**r, "to": dict(r["to"])} for r in self._rows.values()]

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):  # an inner call of a metered one
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            self._local.depth = 1
            try:
                start = time.perf_counter()
                work = fn(*args, **kwargs)
                if work is not None and name not in P2P and hasattr(work, "wait"):
                    work.wait()  # measuring mode: the collective's own time
                seconds = time.perf_counter() - start
            finally:
                self._local.depth = 0
            self._count(name, bound.arguments, seconds)
            return work
        return wrapper

    def _count(self, name: str, a: dict[str, Any], seconds: float) -> None:
        if name == "batch_isend_irecv":
            for p2p in a["p2p_op_list"]:
                # P2POp holds torch's own functions, not the names this meter may have wrapped
                op = "send" if p2p.op in (distributed_c10d.isend, distributed_c10d.send) else "recv"
                self.record(op, 2, tensor_bytes(p2p.tensor), seconds / len(a["p2p_op_list"]), "dist", p2p.peer)
            return
        op, payload = DIST_OPS[name]
        group = a.get("group")
        if op in ("send", "recv"):
            self.record(op, 2, payload(a), seconds, "dist", a.get("dst", a.get("src")))
        else:
            self.record(op, dist.get_world_size(group), payload(a), seconds, "dist", ring_next(group))

    def _dist_names(self) -> list[str]:
        """The ``torch.distributed`` attributes ``patch_dist`` wraps."""
        return [n for n in (*DIST_OPS, "batch_isend_irecv") if hasattr(dist, n)]

    @contextlib.contextmanager
    def patch_dist(self) -> Iterator["CommMeter"]:
        """Wrap the ``torch.distributed`` collectives (namespace attributes) while active."""
        with patched_dist_names(self._dist_names(), self._wrap):
            yield self

    @contextlib.contextmanager
    def active(self) -> Iterator["CommMeter"]:
        """Meter everything: ``torch.distributed`` calls and DTensor functional collectives."""
        with self.patch_dist(), FuncolMeter(self) as debug:
            yield self
        self.debug_counts = {str(k): v for k, v in debug.get_comm_counts().items()}
        self.unmetered = unmetered(self.debug_counts, self.rows)


# CommDebugMode's names for c10d (non-functional) collectives -> our op names
_DEBUG_OPS = {"c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce",
              "c10d._allgather_base_": "all_gather", "c10d.allgather_": "all_gather",
              "c10d._reduce_scatter_base_": "reduce_scatter", "c10d.reduce_scatter_": "reduce_scatter",
              "c10d.broadcast_": "broadcast", "c10d.alltoall_base_": "all_to_all"}


def unmetered(debug_counts: dict[str, int], rows: list[dict[str, Any]]) -> dict[str, int]:
    """Collectives CommDebugMode saw that the meter did not: issued from C++ without Python.

    E.g. DDP's one-off broadcast of rebuilt bucket indices on its second iteration
    (``Reducer::sync_bucket_indices``); their bytes are unknown here, so they are named.
    """
    seen: dict[str, int] = {}
    for row in rows:
        if row["source"] == "dist":
            seen[row["op"]] = seen.get(row["op"], 0) + row["count"]
    wanted: dict[str, int] = {}
    for name, count in debug_counts.items():
        if name in _DEBUG_OPS:
            wanted[_DEBUG_OPS[name]] = wanted.get(_DEBUG_OPS[name], 0) + count
    return {op: n - seen.get(op, 0) for op, n in wanted.items() if n > seen.get(op, 0)}


def route_ddp_through_python(ddp: torch.nn.Module) -> None:
    """Make DDP all-reduce its buckets with ``dist.all_reduce`` (torch's stock allreduce_hook).

    Call before the first backward. Same maths as the C++ default: each flat bucket
    (the gradients it holds, concatenated) is divided by n and all-reduced with SUM.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)


_FUNCOL = torch.ops._c10d_functional


def _funcol_payload(name: str, args: tuple) -> tuple[str, int, int] | None:
    """(op, payload bytes, group size) of a functional collective, None for anything else."""
    if name == "all_reduce":  # (input, reduce_op, group_name)
        return "all_reduce", tensor_bytes(args[0]), _group(args[2]).size()
    if name == "all_gather_into_tensor":  # (input, group_size, group_name): the output is n x input
        return "all_gather", tensor_bytes(args[0]) * args[1], args[1]
    if name == "reduce_scatter_tensor":  # (input, reduce_op, group_size, group_name)
        return "reduce_scatter", tensor_bytes(args[0]), args[2]
    if name == "all_to_all_single":  # (input, output_splits, input_splits, group_name)
        return "all_to_all", tensor_bytes(args[0]), _group(args[3]).size()
    if name == "broadcast":  # (input, src, group_name)
        return "broadcast", tensor_bytes(args[0]), _group(args[2]).size()
    return None


def ring_next(group: dist.ProcessGroup | None) -> int:
    """The global rank after this one in ``group``'s rank order: where a ring collective sends this rank's bytes."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group  # name -> group (no public API)
    return _resolve_process_group(group_name)


def _meter_funcol(meter: CommMeter, func: Any, types: tuple, args: tuple, call: Callable[[], Any]) -> Any:
    """``call()`` the dispatched op; a functional collective on plain tensors is waited for and metered."""
    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", "")
    info = None
    if packet is not None and hasattr(_FUNCOL, name) and getattr(_FUNCOL, name) is packet \
            and not any(t is DTensor for t in types):
        info = _funcol_payload(name, args)
    if info is None:
        return call()
    start = time.perf_counter()
    out = call()
    for t in out if isinstance(out, (list, tuple)) else (out,):
        _FUNCOL.wait_tensor(t)  # measuring mode: the collective's own time
    group = _group(args[{"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
                         "all_to_all_single": 3, "broadcast": 2}[name]])
    meter.record(info[0], info[2], info[1], time.perf_counter() - start, "funcol", ring_next(group))
    return out


class _NoModuleTracker:
    """Stands in for CommDebugMode's module tracker: always at the top level, never in backward.

    The tracker registers global module hooks whose ``BackwardHook`` objects end up in
    reference cycles through autograd nodes that outlive the session (and keep every
    module of the step alive, FSDP's states and their process groups with them). The
    meter needs CommDebugMode's counts only, not its per-module breakdown.
    """

    name = "Global"
    is_bw = False
    activation_checkpointing = False

    def __init__(self) -> None:
        self.module_parents_dict: dict[str, set[str]] = {"Global": set()}  # CommDebugMode reads it per collective

    def __enter__(self) -> "_NoModuleTracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class FuncolMeter(CommDebugMode):
    """CommDebugMode that also meters payload and time of each DTensor functional collective."""

    def __init__(self, meter: CommMeter) -> None:
        super().__init__()
        self.advanced_module_tracker = _NoModuleTracker()  # private attribute: see _NoModuleTracker
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _meter_funcol(self.meter, func, types, args,
                             lambda: super(FuncolMeter, self).__torch_dispatch__(func, types, args, kwargs))


def _main() -> None:
    dist.init_process_group("gloo")
    meter = CommMeter()
    with meter.active():
        dist.all_reduce(torch.ones(1 << 16))
        out = torch.empty(dist.get_world_size() * 1024)
        dist.all_gather_into_tensor(out, torch.ones(1024))
    print(dist.get_rank(), meter.rows, meter.debug_counts)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
