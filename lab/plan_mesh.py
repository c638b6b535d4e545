"""Where each parallel group lands: the (pp, dp, tp) mesh on nodes, and the layout fields.

Mesh order is ``(pp, dp, tp)`` with tp fastest (DESIGN §3): global rank
``(pp_i * dp + dp_i) * tp + tp_i``, and rank r sits on node ``r // gpus_per_node``. A
group is "intra" when every group of that axis stays inside one node, and "inter"
when any of them crosses nodes (the slowest group sets the pace of a collective).

``Layout`` reads the attributes of ``lab.parallel.Parallel`` (dp, tp, pp, zero,
fsdp_strategy, schedule, microbatches, virtual_stages, sequence_parallel,
activation_checkpointing) from any object or plain dict, without importing it.
Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

FSDP_ZERO = {"no_shard": 0, "grad_op": 2, "full": 3, "hybrid": 3}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
             "interleaved_zero_bubble", "zbv", "dualpipev")  # lab.parallel's names
_SCHEDULE_KEYS = {"".join(c for c in s if c.isalnum()): s for s in SCHEDULES}
_SCHEDULE_KEYS.update({"interleaved": "interleaved_1f1b", "schedule1f1b": "1f1b",
                       "schedulegpipe": "gpipe", "scheduleinterleaved1f1b": "interleaved_1f1b",
                       "zerobubble": "interleaved_zero_bubble", "zbvzerobubble": "zbv"})
MULTI_STAGE = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")


def normalize_schedule(name: str) -> str:
    """Map "Interleaved1F1B", "interleaved-1f1b", "ScheduleGPipe" ... to lab.parallel's names."""
    key = "".join(c for c in str(name).lower() if c.isalnum())
    if key not in _SCHEDULE_KEYS:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return _SCHEDULE_KEYS[key]


@dataclass(frozen=True)
class Layout:
    """The resolved layout: sizes, the ZeRO stage in effect, and the pipeline schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # the ZeRO stage in effect on the dp axis (from fsdp_strategy when given)
    fsdp_strategy: str | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (v)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False

    @property
    def world(self) -> int:
        """dp · tp · pp."""
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        """e.g. "TP8×PP16×DP8 ZeRO-1" (the seeds' way of naming a layout)."""
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        shard = f"FSDP {self.fsdp_strategy}" if self.fsdp_strategy else f"ZeRO-{self.zero}"
        text = "×".join(p for p in parts if not p.endswith("P1") or p == "DP1") + " " + shard
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return text


def _get(parallel: Any, name: str, default: Any) -> Any:
    if isinstance(parallel, Mapping):
        value = parallel.get(name, default)
    else:
        value = getattr(parallel, name, default)
    return default if value is None else value


def layout_from(parallel: Any, *, schedule: str | None = None,
                activation_checkpointing: bool | None = None) -> Layout:
    """Build a Layout from a Parallel-like object or dict; explicit arguments win."""
    dp, tp, pp = (int(_get(parallel, k, 1)) for k in ("dp", "tp", "pp"))
    if min(dp, tp, pp) < 1:
        raise ValueError(f"dp, tp and pp must be >= 1, got dp={dp}, tp={tp}, pp={pp}")
    strategy = _get(parallel, "fsdp_strategy", None)
    zero = int(_get(parallel, "zero", 0))
    if strategy is not None:
        if strategy not in FSDP_ZERO:
            raise ValueError(f"unknown fsdp_strategy {strategy!r}; use one of {', '.join(FSDP_ZERO)}")
        implied = FSDP_ZERO[strategy]
        ok = zero in (0, implied) or (strategy == "hybrid" and zero == 2)
        if not ok:
            raise ValueError(f"zero={zero} disagrees with fsdp_strategy={strategy!r}")
        zero = zero if strategy == "hybrid" and zero == 2 else implied
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0..3, got {zero}")
    sched = normalize_schedule(schedule or _get(parallel, "schedule", "1f1b"))
    v = int(_get(parallel, "virtual_stages", 2 if sched in MULTI_STAGE else 1))
    ac = activation_checkpointing
    if ac is None:
        ac = bool(_get(parallel, "activation_checkpointing", False))
    return Layout(dp, tp, pp, zero, strategy, sched, v,
                  bool(_get(parallel, "sequence_parallel", False)), bool(ac))


def axis_groups(dp: int, tp: int, pp: int, axis: str) -> list[list[int]]:
    """Global ranks of every group along ``axis`` ("tp", "dp" or "pp") of the (pp, dp, tp) mesh."""
    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t
    if axis == "tp":
        return [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
    if axis == "dp":
        return [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    if axis == "pp":
        return [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    raise ValueError(f"axis must be tp, dp or pp, not {axis!r}")


def groups_link(groups: list[list[int]], gpus_per_node: int) -> str:
    """"intra" if every group stays on one node, else "inter"."""
    for group in groups:
        if len({r // gpus_per_node for r in group}) > 1:
            return "inter"
    return "intra"


def axis_link(layout: Layout, axis: str, gpus_per_node: int) -> str:
    """The link an axis's collectives cross, given the mesh order and node size."""
    return groups_link(axis_groups(layout.dp, layout.tp, layout.pp, axis), gpus_per_node)


def hybrid_shard_size(dp: int, tp: int, gpus_per_node: int) -> int:
    """HYBRID_SHARD: shard over the dp ranks that share a node, replicate across nodes
    (seeds/000: "ノード内 FSDP、ノード間 DDP"). The largest divisor of dp that fits in a node."""
    per_node = max(1, gpus_per_node // tp)
    return max(d for d in range(1, dp + 1) if dp % d == 0 and d <= per_node)


def hybrid_groups(layout: Layout, gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups): each dp group split into consecutive shard blocks."""
    s = hybrid_shard_size(layout.dp, layout.tp, gpus_per_node)
    shard, replicate = [], []
    for group in axis_groups(layout.dp, layout.tp, layout.pp, "dp"):
        shard += [group[i:i + s] for i in range(0, len(group), s)]
        replicate += [group[j::s] for j in range(s)]
    return shard, replicate
