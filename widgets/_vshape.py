"""The V-shape guide of ZBV and DualPipeV timelines: where the first micro-batch's forwards ran.

A V schedule places stages r and 2p-1-r on rank r, so one micro-batch's forward runs down
the ranks (stage 0 on rank 0 to stage p-1 on rank p-1) and back up (stage p on rank p-1 to
stage 2p-1 on rank 0). The guide joins those forward boxes in stage order; it is drawn only
where the measured stage-to-rank map really is that V.
"""
from __future__ import annotations

from typing import Any

COMPUTE = ("F", "B", "I", "W")


def is_v_shape(ranks: list[int], stages: list[int | None], kinds: list[str]) -> bool:
    """True when the 2p stages sit on the p ranks as a V: stage s and stage 2p-1-s on one rank, each rank
    holding exactly two."""
    where: dict[int, int] = {}
    for rank, stage, kind in zip(ranks, stages, kinds):
        if kind in COMPUTE and stage is not None:
            where[stage] = rank
    p = len(set(where.values()))
    if p < 2 or sorted(where) != list(range(2 * p)):
        return False
    down = [where[s] for s in range(p)]
    return len(set(down)) == p and all(where[2 * p - 1 - s] == where[s] for s in range(p))


def v_path(cols: dict[str, Any]) -> dict[str, list]:
    """The first micro-batch's forward boxes in stage order, ``{rank, stage, mid}`` (mid: the box's middle,
    ms), or empty lists when the timeline is not a V (``is_v_shape``)."""
    out: dict[str, list] = {"rank": [], "stage": [], "mid": []}
    if not is_v_shape(cols["rank"], cols["stage"], cols["kind"]):
        return out
    forwards = [(s, r, (a + b) / 2, m) for r, s, k, m, a, b in
                zip(*(cols[key] for key in ("rank", "stage", "kind", "mb", "start", "end"))) if k == "F"]
    first = min(m for *_, m in forwards)
    for stage, rank, mid, _ in sorted(f for f in forwards if f[3] == first):
        for key, value in zip(out, (rank, stage, round(mid, 3))):
            out[key].append(value)
    return out
