"""Where each parallel group lands: the (pp, dp, tp) mesh on nodes, and the layout fields.

Mesh order is ``(pp, dp, tp)`` with tp fastest (docs/design.md#mesh-order): global rank
``(pp_i * D + d_i) * tp + tp_i`` with D = dp·cp ranks on the data axis, unless the layout names another ``mesh_order``
(ranks run row-major over it, ``kernels.contract.layout_rules.coords``); rank r sits on node
``r // gpus_per_node``. A group is "intra" when every group of that axis stays inside
one node, and "inter" when any of them crosses nodes (the slowest group sets the pace of a collective).

The data axis holds dp replicas of cp context-parallel ranks each, cp fastest: d = dp_i·cp + cp_i
(``kernels.parallel.mesh.ParallelDims.coords``), and a replica index splits for the experts as
dp_i = r·ep + ep_i (``kernels.parallel.mesh.build_ep_mesh``): an expert group is ep dp-neighbours.

``Layout`` reads the attributes of ``lab.run.parallel.Parallel`` (dp, tp, pp, ep, cp, zero,
fsdp_strategy, dp_replicate, schedule, microbatches, stages_per_rank, sequence_parallel,
loss_parallel, activation_checkpointing, mesh_order, stage_layers) from any object or plain dict, without importing it, and
resolves them with the rules of ``kernels.contract.layout_rules``. Pure Python; no torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

from kernels.contract.layout_combinations import stage_layers_problems
from kernels.contract.layout_rules import (MESH_AXES, canonical_schedule, coords, default_stages_per_rank, hsdp_split,
                                  mesh_order_problems, stage_problems, zero_stage)


@dataclass(frozen=True)
class Layout:
    """The resolved layout: sizes, the ZeRO stage in effect, and the pipeline schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # the ZeRO stage in effect on the dp axis (from fsdp_strategy when given)
    fsdp_strategy: str | None = None
    schedule: str = "1f1b"
    stages_per_rank: int = 1  # pipeline stages on each pp rank (v)
    sequence_parallel: bool = False
    activation_checkpointing: bool | str = False  # True: full recompute; "selective": all but matmuls and collectives
    dp_replicate: int = 1  # HSDP replicate groups (dp = dp_replicate * dp_shard); 1 without hybrid
    loss_parallel: bool = False  # cross-entropy on vocab-sharded logits (tp > 1, pp == 1): they are never gathered
    mesh_order: tuple[str, ...] = MESH_AXES  # rank order over the axes, outermost first
    ep: int = 1  # expert parallelism: each MoE layer's experts split over groups of ep dp ranks (ep divides dp)
    cp: int = 1  # context parallelism: each sequence split over cp ranks of the data axis, attention as a ring
    stage_layers: tuple[int, ...] | None = None  # blocks per pipeline stage, in stage order; None: equal stages

    @property
    def world(self) -> int:
        """dp · cp · tp · pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks whose gradients meet, dp · cp: context-parallel ranks hold the same weights."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp · stages_per_rank."""
        return self.pp * self.stages_per_rank

    @property
    def dp_shard(self) -> int:
        """Ranks one parameter is sharded over: dp · cp / dp_replicate (all of dp · cp without HSDP)."""
        return self.data_ranks // self.dp_replicate

    def describe(self) -> str:
        """e.g. "TP8×PP16×DP8 ZeRO-1", "CP2×PP2×DP16 EP8 ZeRO-1" (the sizing guides' way of naming a layout)."""
        parts = [f"TP{self.tp}", f"CP{self.cp}", f"PP{self.pp}", f"DP{self.dp}"]
        shard = f"FSDP {self.fsdp_strategy}" if self.fsdp_strategy else f"ZeRO-{self.zero}"
        text = "×".join(p for p in parts if not p.endswith("P1") or p == "DP1")
        text += (f" EP{self.ep} " if self.ep > 1 else " ") + shard
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else "")
            text += f" stages={'/'.join(map(str, self.stage_layers))}" if self.stage_layers else ""
        if self.mesh_order != MESH_AXES:
            text += " order=" + ",".join(self.mesh_order)
        return text


def _get(parallel: Any, name: str, default: Any) -> Any:
    if isinstance(parallel, Mapping):
        value = parallel.get(name, default)
    else:
        value = getattr(parallel, name, default)
    return default if value is None else value


def layout_from(parallel: Any, *, schedule: str | None = None, activation_checkpointing: bool | str | None = None,
                ep: int | None = None, cp: int | None = None) -> Layout:
    """Build a Layout from a Parallel-like object or dict; explicit arguments win.

    Raises ValueError for sizes below 1, an ep that does not divide dp, an unknown schedule or FSDP strategy, a ZeRO
    stage that disagrees with the strategy, a stage count the schedule cannot run,
    loss_parallel with a pipeline (as ``Parallel.check``'s rule "loss-parallel-pp"), or a
    mesh_order that does not name pp, dp and tp once each.
    """
    dp, tp, pp = (int(_get(parallel, k, 1)) for k in ("dp", "tp", "pp"))
    ep, cp = int(ep or _get(parallel, "ep", 1)), int(cp or _get(parallel, "cp", 1))
    if min(dp, tp, pp, ep, cp) < 1:
        raise ValueError(f"dp, tp, pp, ep and cp must be >= 1, got dp={dp}, tp={tp}, pp={pp}, ep={ep}, cp={cp}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}: the experts are split over groups of ep data-parallel ranks")
    strategy = _get(parallel, "fsdp_strategy", None)
    zero = zero_stage(int(_get(parallel, "zero", 0)), strategy)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0..3, got {zero}")
    replicate = 1
    if strategy == "hybrid":
        replicate, _ = hsdp_split(dp * cp, _get(parallel, "dp_replicate", None))
    sched = canonical_schedule(schedule or _get(parallel, "schedule", "1f1b"))
    v = int(_get(parallel, "stages_per_rank", default_stages_per_rank(sched)))
    problems = stage_problems(sched, v)
    if problems:
        raise ValueError(problems[0][1])
    ac = activation_checkpointing
    if ac is None:
        ac = _get(parallel, "activation_checkpointing", False)
    loss_parallel = bool(_get(parallel, "loss_parallel", False))
    if loss_parallel and pp > 1:
        raise ValueError(f"loss_parallel needs pp == 1, got pp={pp}: a pipeline schedule computes the loss "
                         "inside its last stage")
    order = _get(parallel, "mesh_order", MESH_AXES)
    for _, message in mesh_order_problems(order):
        raise ValueError(message)
    split = _get(parallel, "stage_layers", None)
    for _, message in stage_layers_problems(split, pp, pp * v):
        raise ValueError(message)
    return Layout(dp, tp, pp, zero, strategy, sched, v, bool(_get(parallel, "sequence_parallel", False)),
                  ac if ac == "selective" else bool(ac), replicate, loss_parallel and tp > 1, tuple(order), ep, cp,
                  None if split is None else tuple(split))


def axis_groups(dp: int, tp: int, pp: int, axis: str, order: tuple[str, ...] = MESH_AXES) -> list[list[int]]:
    """Global ranks of every group along ``axis`` ("tp", "dp" or "pp") of the mesh with ranks in ``order``.

    Each group lists its ranks by their index on ``axis`` (with the other indices fixed, a rank
    grows with it); groups come in order of their lowest rank.
    """
    if axis not in MESH_AXES:
        raise ValueError(f"axis must be tp, dp or pp, not {axis!r}")
    dims = {"dp": dp, "tp": tp, "pp": pp}
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(dp * tp * pp):
        at = coords(rank, dims, order)
        groups.setdefault(tuple(at[a] for a in MESH_AXES if a != axis), []).append(rank)
    return list(groups.values())


def groups_link(groups: list[list[int]], gpus_per_node: int) -> str:
    """"intra" if every group stays on one node, else "inter"."""
    for group in groups:
        if len({r // gpus_per_node for r in group}) > 1:
            return "inter"
    return "intra"


def layout_groups(layout: Layout, axis: str) -> list[list[int]]:
    """Every group of ``axis`` in the layout's mesh: "tp", "pp", "dp" (the data axis: the dp · cp ranks whose
    gradients meet), "cp" (one dp replica's ring), "ep" (ep dp-neighbours that split the experts) or
    "ep_replicate" (the dp/ep · cp ranks that hold the same experts); see the module docstring."""
    if axis not in (*MESH_AXES, "cp", "ep", "ep_replicate"):
        raise ValueError(f"axis must be tp, pp, dp, cp, ep or ep_replicate, not {axis!r}")
    data = axis_groups(layout.data_ranks, layout.tp, layout.pp, axis if axis in MESH_AXES else "dp",
                       layout.mesh_order)
    if axis in MESH_AXES:
        return data
    ep, cp, replicas = layout.ep, layout.cp, layout.dp // layout.ep
    out = []
    for g in data:
        at = [[[g[(r * ep + e) * cp + c] for c in range(cp)] for e in range(ep)] for r in range(replicas)]  # [r][e][c]
        if axis == "cp":
            out += [at[r][e] for r in range(replicas) for e in range(ep)]
        elif axis == "ep":
            out += [[at[r][e][c] for e in range(ep)] for r in range(replicas) for c in range(cp)]
        else:
            out += [[at[r][e][c] for r in range(replicas) for c in range(cp)] for e in range(ep)]
    return out


def axis_link(layout: Layout, axis: str, gpus_per_node: int) -> str:
    """The link an axis's collectives cross (any axis ``layout_groups`` names), given the mesh order and node size."""
    return _mesh_link(layout.dp, layout.tp, layout.pp, layout.ep, layout.cp, tuple(layout.mesh_order), axis,
                      gpus_per_node)


# recommend() asks the same (mesh, axis) of every candidate's every pipeline rank: 16x faster at 1024 GPUs.
@functools.lru_cache(maxsize=4096)
def _mesh_link(dp: int, tp: int, pp: int, ep: int, cp: int, order: tuple[str, ...], axis: str,
               gpus_per_node: int) -> str:
    mesh = Layout(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, mesh_order=order)
    return groups_link(layout_groups(mesh, axis), gpus_per_node)


def hybrid_groups(layout: Layout) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups): each data-axis group split into consecutive blocks of dp_shard ranks."""
    s = layout.dp_shard
    shard, replicate = [], []
    for group in layout_groups(layout, "dp"):
        shard += [group[i:i + s] for i in range(0, len(group), s)]
        replicate += [group[j::s] for j in range(s)]
    return shard, replicate
