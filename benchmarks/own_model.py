"""A Hugging Face model in the lab against the same model under torchrun, measured in one run on this machine.

An HF Llama built from a tiny config (nothing downloaded) under DP4, TP2×DP2 and PP2×DP2 on 4 CPU
ranks (gloo): the steady-state step time (median over steps after warm-up of the slowest rank's
time) through ``lab.Experiment.run`` on a warm pool, beside ``kernels.train.entry`` under
``torchrun`` on the experiment's exact config (goal: lab ≤ 1.05×). Both use one thread per rank.

Run: ``python benchmarks/own_model.py [--steps 30]``
"""
from __future__ import annotations

import argparse
import warnings

from transformers import LlamaConfig

import lab
from vs_torchrun import run_torchrun, steady_step

MODEL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)
LAYOUTS = {"DP4": lab.Parallel(dp=4), "TP2×DP2": lab.Parallel(tp=2, dp=2),
           "PP2×DP2": lab.Parallel(pp=2, dp=2, microbatches=4)}
GLOBAL_BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with lab.start(n=4, backend="gloo", threads_per_rank=1, activate=False) as cluster:
        for name, parallel in LAYOUTS.items():
            exp = lab.Experiment(cluster, MODEL, parallel, global_batch=GLOBAL_BATCH, steps=args.steps)
            lab_step = steady_step(exp.run(progress=False).step_times)
            raw_step = steady_step(run_torchrun(exp, threads=1)[1])
            print(f"HF Llama {name} steady step: lab {lab_step * 1e3:.2f} ms, torchrun {raw_step * 1e3:.2f} ms, "
                  f"ratio {lab_step / raw_step:.2f}x (goal <= 1.05x)")


if __name__ == "__main__":
    main()
