"""bf16 autocast for the layouts FSDP2 does not cover: no parallelism, DDP, ZeRO-1, TP/SP and pipeline stages.

Algorithm: automatic mixed precision (Micikevicius et al., 2018, "Mixed Precision
Training") as ``torch.autocast`` does it: the weights stay fp32 masters, and inside the
forward each matmul-like op runs on bf16 copies of its inputs while reductions and norms
stay fp32. Backward replays the dtypes forward chose, so it runs outside the context.
FSDP2 layouts get bf16 from their ``MixedPrecisionPolicy`` instead (bf16 parameters
gathered, fp32 gradients reduced), which is what FSDP users set.

The context is put around the module's own ``forward`` rather than around the training
step: a pipeline schedule runs forward and backward inside one call, and a backward
under autocast would round differently from the reference's. Wrapping ``forward`` in
place keeps parameter names, so records and checkpoints do not change.

Run alone (one process: the same loss in fp32 and under bf16 autocast)::

    python -m kernels.parallel.autocast
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn


def apply_autocast(module: nn.Module, device_type: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Run ``module``'s forward under ``torch.autocast(device_type, dtype)`` from now on; returns the module."""
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = autocast_forward
    return module


if __name__ == "__main__":
    from kernels.model.gpt import GPTConfig, build_gpt, loss_fn

    cfg = GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    fp32, bf16 = build_gpt(cfg), apply_autocast(build_gpt(cfg), "cpu")
    print("fp32", loss_fn(fp32(x), y).item(), "bf16 autocast", loss_fn(bf16(x), y).item())
