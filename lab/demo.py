"""The main job: the five collectives checked by hand, then a GPT trained in 3D beside one process."""
from __future__ import annotations

from typing import Any

from kernels.engine.collectives import collective_inputs, run_collectives
from lab.pool.cluster import Cluster
from lab.run.experiment import Experiment
from lab.run.parallel import Parallel
from lab.run.run_result import RunResult

DEMO_MODEL = dict(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)


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


def demo_layout(world: int) -> Parallel:
    """As many parallel axes as ``world`` allows: TP2 inside, then PP2, DP over the rest.

    8 ranks give PP2×DP2×TP2 (3D); 4 give PP2×TP2; an odd world falls back to DP.
    """
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if (world // tp) % 2 == 0 else 1
    dp = world // (tp * pp)
    return Parallel(dp=dp, tp=tp, pp=pp, schedule="1f1b", microbatches=4 if pp > 1 else 1)


def train_demo(cluster: Cluster, steps: int = 5) -> tuple[Parallel, RunResult, RunResult]:
    """Train the demo GPT under ``demo_layout`` on the ranks and in one process."""
    from kernels.model.gpt import GPTConfig

    parallel = demo_layout(cluster.world_size)
    global_batch = 4 * parallel.dp * parallel.num_microbatches
    exp = Experiment(cluster, GPTConfig(**DEMO_MODEL), parallel, global_batch=global_batch, steps=steps, lr=5e-3)
    return parallel, exp.run(), exp.reference()
