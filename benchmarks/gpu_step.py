"""One GPU: the lab's training step against plain torch eager, on a GPT of 219M parameters, in one run.

Shape: GPT L12 D1024 H16 V32768 S1024, global batch 16 (``kernels.model.gpt``'s GPT, so both
sides train the same model). Three measurements, each the median step time after warm-up:

1. **plain torch** (the baseline): one process, no torch.distributed; bf16 autocast, fused
   AdamW, TF32 matmuls, the batch already on the GPU: what a careful single-GPU script does;
2. **the lab, defaults**: ``lab.start(n=1)`` (one NCCL rank), ``Parallel(dp=1,
   mixed_precision="bf16")`` through ``lab.Experiment.run``: the rank's own loop, its batches
   built ahead on the CPU, its gradient norm every step;
3. **the lab, compile=True**: the same with ``torch.compile`` on each block.

It prints ms/step, tokens/s and MFU against the GPU's bf16 dense peak (looked up by the GPU's
name in ``lab.measure.throughput.PEAK_BF16_DENSE``, 989 TFLOP/s for an H100 SXM; ``--peak-tflops``
for others), with the model FLOPs per step of ``lab.measure.throughput.flops_per_token``:
6·N·tokens + 12·L·D·S·tokens (Narayanan et al., 2021; docs/design.md#overlap-model-flops-and-mfu),
and the ratios of the lab's tokens/s to plain torch's. Goals: defaults ≥ 0.97×, compile ≥ 1.05×.

Without a GPU it measures nothing, says so, and exits 0.

Run: ``python benchmarks/gpu_step.py [--steps 20] [--warmup 5]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPE = {"layers": 12, "d_model": 1024, "heads": 16, "vocab": 32768, "seq_len": 1024}
GLOBAL_BATCH = 16


def flops_per_step() -> float:
    """Model FLOPs of one step of the benchmark's GPT (forward and backward, no recomputation)."""
    from kernels.model.family import model_fields
    from kernels.model.gpt import GPTConfig
    from lab.measure.throughput import flops_per_token

    return flops_per_token(model_fields(GPTConfig(**SHAPE)))[0] * GLOBAL_BATCH * SHAPE["seq_len"]


def report(rows: dict[str, float], baseline_s: float, peak_flops: float) -> str:
    """The table: per measurement ms/step, tokens/s, MFU against ``peak_flops`` (one device) and speed vs plain."""
    flops, tokens = flops_per_step(), GLOBAL_BATCH * SHAPE["seq_len"]
    lines = [f"{flops / 1e12:.2f} TFLOP per step, peak {peak_flops / 1e12:.0f} TFLOP/s",
             f"{'':45s} {'ms/step':>8s} {'tokens/s':>10s} {'MFU':>6s} {'vs plain':>8s}"]
    for name, seconds in rows.items():
        mfu = flops / seconds / peak_flops
        lines.append(f"{name:45s} {seconds * 1e3:8.1f} {tokens / seconds:10,.0f} {mfu:6.1%} {baseline_s / seconds:7.2f}×")
    return "\n".join(lines)


def plain_torch(steps: int, warmup: int) -> tuple[float, int]:
    """(median seconds per step, parameter count) of the plain single-GPU loop."""
    from kernels.train.data import SyntheticTokens
    from kernels.model.gpt import GPTConfig, build_gpt, loss_fn

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda", 0)
    model = build_gpt(GPTConfig(**SHAPE), device=device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = (t.to(device) for t in SyntheticTokens(SHAPE["vocab"], SHAPE["seq_len"]).global_batch(0, GLOBAL_BATCH))
    times = []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - began)
    del model, optimizer
    torch.cuda.empty_cache()
    return statistics.median(times), params


def lab_step(cluster, steps: int, warmup: int, compile: bool) -> float:
    """Median seconds per step of the lab's one-rank run (steps after the warm-up ones)."""
    import lab

    exp = lab.Experiment(cluster, lab.GPT(**SHAPE), lab.Parallel(dp=1, mixed_precision="bf16"),
                         global_batch=GLOBAL_BATCH, steps=warmup + steps, lr=1e-4, compile=compile)
    return statistics.median(exp.run().step_times[0][warmup:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's bf16 dense peak (default: known by its name)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step: no CUDA GPU is visible, so nothing was measured (run it on a GPU machine)")
        return 0
    import lab

    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"GPT {SHAPE}, batch {GLOBAL_BATCH}, {args.steps} steps after {args.warmup} warm-up")
    plain_s, params = plain_torch(args.steps, args.warmup)
    with lab.start(n=1) as cluster:  # the lab's one NCCL rank, in its own engine process
        rows = {"plain torch (eager, autocast, fused AdamW)": plain_s,
                "lab default (1 NCCL rank, bf16)": lab_step(cluster, args.steps, args.warmup, compile=False),
                "lab compile=True": lab_step(cluster, args.steps, args.warmup, compile=True)}
    from lab.measure.throughput import peak_flops

    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(torch.cuda.get_device_name(0))
    print(f"{params / 1e6:.1f}M parameters")
    print(report(rows, plain_s, peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())
