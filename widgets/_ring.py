"""Pure transforms behind CollectiveView: the ring algorithms replayed on the ranks' real inputs.

The ranks ran the real collectives (``kernels.engine.collectives.run_collectives``); here a
teaching twin replays the textbook ring algorithm (Patarasuk & Yuan, 2009; the
schedule NCCL's ring uses) on the same input values, one frame per step, and checks
that the values the twin ends with equal the outputs the ranks really returned.

A frame is ``{phase, step, sends: [[src, dst, chunk]], updates: [[rank, chunk, cell]]}``:
frame 0 carries the whole grid as ``cells`` instead, later frames only the cells that
the step's sends changed (so the state grows as world², not world³; ``_cells_at``
replays them). A cell is ``{"v": [floats], "from": [ranks summed into it]}``, or None
where the rank holds nothing of that chunk yet.
"""
from __future__ import annotations

import copy
import math
from typing import Any

from kernels.contract.measure_records import CollectiveRecord

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def _flat(records: list[Any]) -> list[dict[str, Any]]:
    """CollectiveRecord dicts, each checked by ``from_dict``, from a flat list or one list per rank (as
    cluster.run returns them)."""
    flat = [r for item in records for r in (item if isinstance(item, list) else [item])]
    return [CollectiveRecord.coerce(r).to_dict() for r in flat]


def _group(records: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """{op: records in rank order}."""
    flat = _flat(records)
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in sorted(flat, key=lambda r: r["rank"]):
        out.setdefault(rec["op"], []).append(rec)
    order = [op for op in OPS if op in out] + sorted(op for op in out if op not in OPS)
    return {op: out[op] for op in order}


def _split(values: list[float], n: int) -> list[list[float]]:
    """n contiguous chunks whose sizes differ by at most one (some are empty when len < n)."""
    bounds = [(c * len(values)) // n for c in range(n + 1)]
    return [list(values[bounds[c]:bounds[c + 1]]) for c in range(n)]


def _cell(values: list[float], rank: int) -> dict[str, Any]:
    return {"v": [float(x) for x in values], "from": [rank]}


def _run_steps(frames: list[dict], cells: list[list], phase: str, steps: list[list[list[int]]], add: bool) -> list:
    """Apply ring steps (all sends of a step at once, from the previous frame's values)."""
    for i, sends in enumerate(steps):
        updates = []
        for src, dst, c in sends:
            sent, held = cells[src][c], cells[dst][c]
            if add and held is not None:  # reduce: add the received partial sum into ours
                cell = {"v": [a + b for a, b in zip(held["v"], sent["v"])],
                        "from": sorted(set(held["from"]) | set(sent["from"]))}
            else:  # gather / broadcast / p2p: overwrite with the received copy
                cell = copy.deepcopy(sent)
            updates.append([dst, c, cell])
        cells = copy.deepcopy(cells)
        for dst, c, cell in updates:
            cells[dst][c] = cell
        frames.append({"phase": phase, "step": i, "sends": sends, "updates": updates})
    return cells


def _cells_at(frames: list[dict], k: int) -> list[list]:
    """The whole grid at frame k: frame 0's cells with the updates of frames 1..k applied."""
    cells = copy.deepcopy(frames[0]["cells"])
    for f in frames[1:k + 1]:
        for dst, c, cell in f["updates"]:
            cells[dst][c] = cell
    return cells


def _reduce_scatter_steps(n: int) -> list[list[list[int]]]:
    """Step s: rank r sends chunk (r-s-1) mod n to r+1, so rank r ends with the whole sum of chunk r."""
    return [[[r, (r + 1) % n, (r - s - 1) % n] for r in range(n)] for s in range(n - 1)]


def _all_gather_steps(n: int) -> list[list[list[int]]]:
    """Step s: rank r forwards chunk (r-s) mod n to r+1; rank r starts holding chunk r."""
    return [[[r, (r + 1) % n, (r - s) % n] for r in range(n)] for s in range(n - 1)]


def _simulate(op: str, inputs: list[list[float]]) -> tuple[list[dict], list[list[float]]]:
    """(frames, final value per rank) of the ring twin of ``op`` on the given per-rank inputs."""
    n = len(inputs)
    if op in ("all_reduce", "reduce_scatter"):
        cells = [[_cell(chunk, r) for chunk in _split(x, n)] for r, x in enumerate(inputs)]
    elif op == "all_gather":
        cells = [[_cell(x, r) if c == r else None for c in range(n)] for r, x in enumerate(inputs)]
    else:
        cells = [[_cell(x, r)] for r, x in enumerate(inputs)]
    frames = [{"phase": "input", "step": 0, "sends": [], "cells": copy.deepcopy(cells), "updates": []}]
    if op in ("all_reduce", "reduce_scatter"):
        cells = _run_steps(frames, cells, "reduce-scatter", _reduce_scatter_steps(n), add=True)
    if op in ("all_reduce", "all_gather"):
        cells = _run_steps(frames, cells, "all-gather", _all_gather_steps(n), add=False)
    if op == "broadcast":  # a chain from rank 0: step s, rank s passes rank 0's value on
        cells = _run_steps(frames, cells, "broadcast", [[[s, s + 1, 0]] for s in range(n - 1)], add=False)
    if op == "send_recv":  # one step: every rank sends to the next one round the ring
        cells = _run_steps(frames, cells, "send/recv", [[[r, (r + 1) % n, 0] for r in range(n)]], add=False)
    if op == "reduce_scatter":
        final = [list(cells[r][r]["v"]) for r in range(n)]
    elif op in OPS:
        final = [[x for chunk in row for x in (chunk["v"] if chunk else [])] for row in cells]
    else:
        final = [list(x) for x in inputs]  # unknown op: nothing to replay
    return frames, final


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a, b))


def _collective_view(records: list[Any]) -> list[dict[str, Any]]:
    """One entry per op: inputs, real outputs, the ring frames, and whether the twin agrees."""
    views = []
    for op, recs in _group(records).items():
        inputs = [list(r["input"]) for r in recs]
        outputs = [list(r["output"]) for r in recs]
        frames, final = _simulate(op, inputs) if op in OPS else ([], outputs)
        bad = [r["rank"] for r, f, o in zip(recs, final, outputs) if not _close(f, o)]
        mismatch = (f"ring twin disagrees with the ranks' real {op} output on ranks {bad}: "
                    f"simulated {[final[i] for i, r in enumerate(recs) if r['rank'] in bad]}, "
                    f"real {[outputs[i] for i, r in enumerate(recs) if r['rank'] in bad]}") if bad else ""
        views.append({"op": op, "world": len(recs), "ranks": [r["rank"] for r in recs], "inputs": inputs,
                      "outputs": outputs, "final": final, "frames": frames, "ok": not bad, "mismatch": mismatch})
    return views
