"""What a checkpoint costs: DCP save and load under three layouts beside torch.save/torch.load, and async saving.

One run on one pool prints:

- per layout (DP 4, ZeRO-3 DP 4, PP 2 x TP 2): the save time (rank 0, from the save's start
  to the renamed directory, ``Checkpoint.save_seconds``), the load time of a resume under
  the same layout (slowest rank, ``load_seconds`` in the rank records) and the bytes on
  disk; beside them ``torch.save``/``torch.load`` of the same consolidated state dict
  (model and AdamW state, whole) in this one process;
- the step-time overhead of ``checkpoint_async=True`` at ``checkpoint_every=1`` against no
  checkpointing (and a synchronous save every step): the extra wall time per step of whole
  runs (the saves happen between steps, outside the step clock), as a share of a step; on
  the pool's ranks (ZeRO-3), and again on a pool of one rank, which leaves the background
  writer a core of its own on a two-core machine;
- ``Training.relayout`` DP4 -> TP2 x DP2 ZeRO-3 beside a torchrun relaunch that loads the same
  checkpoint (``benchmarks/checkpoint_relayout.py``; 4 ranks only).

Run: ``python benchmarks/checkpoint.py [--ranks 4] [--steps 8] [--d-model 256]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch

import lab
from checkpoint_relayout import relayout_vs_torchrun, report
from kernels.checkpoint.save_load import load_checkpoint
from kernels.model.gpt import GPT, GPTConfig
from kernels.train.entry import train_rank

LAYOUTS = {"DP4": dict(dp=4), "ZeRO-3 DP4": dict(dp=4, zero=3), "PP2xTP2": dict(pp=2, tp=2, microbatches=2)}


def _experiment(cluster, model: GPTConfig, parallel: dict, **kwargs) -> lab.Experiment:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.LayoutWarning)
        return lab.Experiment(cluster, model, lab.Parallel(**parallel), global_batch=8, **kwargs)


def dcp_costs(cluster, model: GPTConfig, parallel: dict, root: str) -> tuple[float, float, int]:
    """(save seconds, load seconds, bytes) of one checkpoint after step 1 of ``parallel``."""
    _experiment(cluster, model, parallel, steps=1, checkpoint_dir=root).run()
    saved = lab.checkpoints(root)[-1]
    cfg = _experiment(cluster, model, parallel, steps=2, resume_from=saved).config()
    cfg["resume_from"] = saved.path
    records = cluster.run(train_rank, cfg)
    return saved.save_seconds, max(r["load_seconds"] for r in records), saved.bytes


def torch_save_costs(model: GPTConfig, checkpoint: str, scratch: str) -> tuple[float, float, int]:
    """(save seconds, load seconds, bytes) of torch.save/torch.load of the consolidated model and AdamW state."""
    gpt = GPT(model)
    optimizer = torch.optim.AdamW(gpt.parameters())
    load_checkpoint(checkpoint, gpt, optimizer)  # the same state, whole, in one process
    state = {"model": gpt.state_dict(), "optim": optimizer.state_dict()}
    path = os.path.join(scratch, "consolidated.pt")
    began = time.perf_counter()
    torch.save(state, path)
    saved = time.perf_counter() - began
    began = time.perf_counter()
    torch.load(path, weights_only=True)
    return saved, time.perf_counter() - began, os.path.getsize(path)


def wall_per_step(cluster, model: GPTConfig, steps: int, repeats: int, **kwargs) -> tuple[float, float]:
    """(median wall seconds per step of whole runs, median step-clock seconds per step): ZeRO-3 over the pool's ranks."""
    walls, clocks = [], []
    parallel = dict(dp=cluster.world_size, zero=3) if cluster.world_size > 1 else {}
    for _ in range(repeats):
        exp = _experiment(cluster, model, parallel, steps=steps, **kwargs)
        began = time.perf_counter()
        result = exp.run()
        walls.append((time.perf_counter() - began) / steps)
        clocks.append(statistics.mean(result.step_times[0]))
    return statistics.median(walls), statistics.median(clocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    warnings.simplefilter("ignore", lab.OversubscribedWarning)
    model = lab.GPT(layers=4, d_model=args.d_model, heads=4, vocab=1024, seq_len=64)
    params = sum(p.numel() for p in GPT(model).parameters())
    print(f"model: {params / 1e6:.2f} M parameters ({params * 12 / 1e6:.1f} MB of fp32 weights + AdamW state)")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch, \
            lab.start(n=args.ranks, backend="gloo", activate=False) as cluster:
        print(f"{'layout':<12} {'DCP save s':>10} {'DCP load s':>10} {'DCP MB':>8}   "
              f"{'torch.save s':>12} {'torch.load s':>12} {'torch MB':>8}")
        for name, parallel in LAYOUTS.items():
            root = os.path.join(scratch, name.replace(" ", "_"))
            save_s, load_s, nbytes = dcp_costs(cluster, model, parallel, root)
            t_save, t_load, t_bytes = torch_save_costs(model, lab.checkpoints(root)[-1].path, scratch)
            print(f"{name:<12} {save_s:>10.3f} {load_s:>10.3f} {nbytes / 1e6:>8.2f}   "
                  f"{t_save:>12.3f} {t_load:>12.3f} {t_bytes / 1e6:>8.2f}")
        overheads = [save_overheads(cluster, model, args.steps, args.repeats, os.path.join(scratch, "every"))]
        relayout = relayout_vs_torchrun(cluster, args.repeats) if args.ranks == 4 else None
    if args.ranks > 1:  # one rank on two cores leaves the background writer a core of its own
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch, \
                lab.start(n=1, backend="gloo", activate=False) as single:
            overheads.append(save_overheads(single, model, args.steps, args.repeats, os.path.join(scratch, "every")))
    for ranks, (none, clock, sync, background) in zip((args.ranks, 1), overheads):
        print(f"{'ZeRO-3 DP' + str(ranks) if ranks > 1 else 'one rank'}, {args.steps} steps, median of {args.repeats} "
              f"runs: wall per step (step clock {clock:.3f} s)")
        for label, wall in (("no checkpoints", none), ("sync save every step", sync),
                            ("async save every step", background)):
            print(f"  {label:<24} {wall:.3f} s/step  (+{wall - none:.3f} s per step: {(wall - none) / clock:+.1%} "
                  f"of a step)")
    print(report(relayout) if relayout else "relayout: DP4 -> TP2xDP2 needs --ranks 4")


def save_overheads(cluster, model: GPTConfig, steps: int, repeats: int, root: str) -> tuple[float, ...]:
    """(wall per step without checkpoints, its step clock, wall per step saving every step synchronously, async)."""
    none, clock = wall_per_step(cluster, model, steps, repeats)
    every = dict(checkpoint_dir=root, checkpoint_every=1)
    sync, _ = wall_per_step(cluster, model, steps, repeats, **every)
    background, _ = wall_per_step(cluster, model, steps, repeats, checkpoint_async=True, **every)
    return none, clock, sync, background


if __name__ == "__main__":
    main()
