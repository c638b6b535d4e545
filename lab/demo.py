"""The main job: start the pool, run the five collectives, and check every output by hand."""
from __future__ import annotations

from typing import Any

from kernels.collectives import collective_inputs, run_collectives
from lab.cluster import Cluster


def expected_output(op: str, rank: int, world: int) -> list[float]:
    """What ``op`` must leave on ``rank``, computed from the inputs without torch."""
    inputs = [collective_inputs(op, r, world) for r in range(world)]
    if op == "all_reduce":
        return [sum(col) for col in zip(*inputs)]
    if op == "all_gather":
        return [v for part in inputs for v in part]
    if op == "reduce_scatter":
        return [sum(inp[rank] for inp in inputs)]
    if op == "broadcast":
        return list(inputs[0])
    if op == "send_recv":
        return list(inputs[(rank - 1) % world])
    raise ValueError(f"unknown collective {op!r}")


def check_collectives(cluster: Cluster) -> list[dict[str, Any]]:
    """Run the collectives on every rank; return rows with the expected value and a verdict."""
    per_rank = cluster.run(run_collectives)
    rows = []
    for records in per_rank:
        for rec in records:
            want = expected_output(rec["op"], rec["rank"], cluster.world_size)
            rows.append({**rec, "expected": want, "ok": rec["output"] == want})
    return sorted(rows, key=lambda row: (row["op"], row["rank"]))


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A per-rank table of inputs, outputs and verdicts, grouped by collective."""
    fmt = lambda xs: "[" + ", ".join(f"{v:g}" for v in xs) + "]"  # noqa: E731
    cols = [("collective", 14), ("rank", 4), ("input", 22), ("output", 22), ("expected", 22), ("check", 5)]
    lines = ["  ".join(name.ljust(width) for name, width in cols)]
    for row in rows:
        cells = (row["op"], str(row["rank"]), fmt(row["input"]), fmt(row["output"]), fmt(row["expected"]),
                 "ok" if row["ok"] else "WRONG")
        lines.append("  ".join(c.ljust(w) for c, (_, w) in zip(cells, cols)))
    return "\n".join(lines)
