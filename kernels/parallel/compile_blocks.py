"""Compile each transformer block with ``torch.compile``, the way torchtitan does.

Algorithm: TorchDynamo captures each block's forward into a graph and TorchInductor
generates fused kernels for it (Ansel et al., 2024, "PyTorch 2: Faster Machine Learning
Through Dynamic Python Bytecode Transformation and Graph Compilation"). Blocks are
compiled one by one rather than the whole model: every block has the same shapes, so
one compiled graph serves them all, and the embeddings, the head and the pipeline's
stage boundaries stay in eager mode. ``nn.Module.compile`` compiles in place, so
parameter names (and checkpoints) stay the same.

``kernels.parallel.parallelize`` calls it after tensor parallelism and activation
checkpointing (so the graphs see the DTensor and recompute wrappers) and before FSDP
(so FSDP's hooks stay outside the graphs). On CPU, Inductor needs a C++ compiler.

Run alone (one process, compiled beside eager)::

    python -m kernels.parallel.compile_blocks
"""
from __future__ import annotations

import torch.nn as nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every block of ``model.blocks`` in place; returns the model."""
    for block in model.blocks.values():
        block.compile()
    return model


if __name__ == "__main__":
    import torch

    from kernels.model.gpt import GPTConfig, build_gpt, loss_fn

    cfg = GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    eager, compiled = build_gpt(cfg), apply_compile(build_gpt(cfg))
    print("eager", loss_fn(eager(x), y).item(), "compiled", loss_fn(compiled(x), y).item())
