"""Expert and context parallelism on 4 CPU ranks, each beside its named baseline measured in the same run.

- EP: the lab's GPT with a mixture of 8 experts (top-2 routing, expert width f) under EP2 and EP4
  inside DP4, against the dense GPT of equal ACTIVE parameters (one MLP of width 2f) under DP4, at
  the same global batch: the steady step time (median over steps after warm-up of the slowest
  rank's time), and the all-to-all bytes per rank.
- CP: at three sequence lengths, the same micro-batch of b sequences per rank under cp = 1 (DP4),
  2 (DP2×CP2) and 4 (CP4), so a rank holds s/cp tokens of each sequence: the steady step time and
  the measured peak activation bytes per rank (saved tensors at the end of forward), against cp = 1.

Run: ``python benchmarks/moe_cp.py [--steps 12]``. Figures go in the closing note; there are no goals
here, only what the layouts cost and save on this machine (2 cores, 4 gloo ranks, 1 thread each).
"""
from __future__ import annotations

import argparse
import warnings

import lab
from vs_torchrun import steady_step

WARMUP = 2
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 64
SEQ_LENS = (64, 128, 256)
MICRO_BATCH = 2  # sequences per rank in every CP case


def peak_activations(result) -> int:
    """The largest measured activation bytes of any rank at the end of forward."""
    return max(r["measured"] for r in result.memory_records
               if r["moment"] == "peak_fwd_bwd" and r["category"] == "activations")


def all_to_all_bytes(result) -> int:
    """Rank 0's all-to-all payload bytes in the measured step."""
    return sum(row["payload_bytes"] for row in result.comm() if row["op"] == "all_to_all" and row["rank"] == 0)


def expert_parallel(cluster, steps: int) -> None:
    common = dict(layers=2, d_model=64, heads=4, vocab=256, seq_len=64)
    moe = lab.GPT(**common, d_ff=EXPERT_WIDTH, experts=EXPERTS, top_k=TOP_K)
    dense = lab.GPT(**common, d_ff=TOP_K * EXPERT_WIDTH)  # the same active parameters per token
    base = steady_step(lab.Experiment(cluster, dense, lab.Parallel(dp=4), global_batch=16,
                                steps=steps).run(progress=False).step_times, WARMUP)
    print(f"dense GPT (MLP width {TOP_K * EXPERT_WIDTH}) DP4: {base * 1e3:.1f} ms per step (baseline)")
    for ep in (1, 2, 4):
        exp = lab.Experiment(cluster, moe, lab.Parallel(dp=4, ep=ep), global_batch=16, steps=steps)
        step = steady_step(exp.run(progress=False).step_times, WARMUP)
        sent = all_to_all_bytes(lab.Experiment(cluster, moe, lab.Parallel(dp=4, ep=ep), global_batch=16, steps=2,
                                               measure=True).run(progress=False))
        print(f"MoE {EXPERTS}x{EXPERT_WIDTH} top-{TOP_K} DP4 EP{ep}: {step * 1e3:.1f} ms per step, "
              f"{step / base:.2f}x the dense baseline; all-to-all payload {sent / 1e3:.1f} kB per rank and step")


def context_parallel(cluster, steps: int) -> None:
    for seq_len in SEQ_LENS:
        model = lab.GPT(layers=2, d_model=64, heads=4, vocab=256, seq_len=seq_len)
        runs = {}
        for cp in (1, 2, 4):
            parallel = lab.Parallel(dp=4 // cp, cp=cp)
            batch = MICRO_BATCH * (4 // cp)  # b sequences per rank whatever cp is
            timed = lab.Experiment(cluster, model, parallel, global_batch=batch, steps=steps).run(progress=False)
            measured = lab.Experiment(cluster, model, parallel, global_batch=batch, steps=2,
                                      measure=True).run(progress=False)
            runs[cp] = steady_step(timed.step_times, WARMUP), peak_activations(measured)
        base_t, base_m = runs[1]
        for cp, (t, m) in runs.items():
            print(f"seq {seq_len} cp={cp}: {t * 1e3:.1f} ms per step ({t / base_t:.2f}x cp=1), peak activations "
                  f"{m / 1e6:.2f} MB per rank ({m / base_m:.2f}x cp=1; 1/cp = {1 / cp:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with lab.start(n=4, backend="gloo", threads_per_rank=1, activate=False) as cluster:
        expert_parallel(cluster, args.steps)
        context_parallel(cluster, args.steps)


if __name__ == "__main__":
    main()
