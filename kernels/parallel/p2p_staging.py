"""Pipeline point-to-point through host memory, for gloo ranks that compute on a shared GPU.

gloo runs collectives on CUDA tensors (so DDP, FSDP2 and DTensor TP work when several gloo
ranks share one GPU), but its ``send``/``recv`` crash on them. A pipeline's only traffic is
point-to-point: activations forward and their gradients backward. So while a schedule steps,
every p2p op on a device tensor is rewritten to go through a host copy: a send copies the
tensor to the CPU and sends the copy; a receive receives into a CPU buffer and copies it into
the schedule's device buffer when the schedule waits on it. Sizes, order, peers and tags stay
the schedule's own, so the schedule cannot tell.

The hook is torch's ``schedules._batch_p2p``, through which every schedule sends and receives
(``kernels.measure.trace`` wraps the same function to time p2p: staging goes on first, so the tracer
sees the schedule's own ops and times the staged transfer).

Run alone (two CPU ranks, every transfer staged, beside the same step unstaged)::

    python -m kernels.parallel.p2p_staging
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules


class _StagedWork:
    """A p2p work whose ``wait`` also lands a staged receive in its device buffer."""

    def __init__(self, work: Any, copies: list[tuple[torch.Tensor, torch.Tensor]], keep: list[torch.Tensor]) -> None:
        self._work, self._copies, self._keep = work, copies, keep  # keep: staged sends stay alive until done

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        for host, device in self._copies:
            device.copy_(host)
        self._copies, self._keep = [], []
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _staging(original: Callable, stage_all: bool) -> Callable:
    def staged_batch_p2p(p2p_ops: list, desc: str | None = None) -> list:
        ops, copies, keep = [], [], []
        for op in p2p_ops:
            if op.tensor.device.type == "cpu" and not stage_all:
                ops.append(op)
                copies.append([])
                continue
            if op.op is dist.isend:
                host = op.tensor.detach().to("cpu", copy=True)
                keep.append(host)
                copies.append([])
            else:
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device="cpu")
                copies.append([(host, op.tensor)])
            ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        works = original(ops, desc)
        if len(works) == len(ops):  # one work per op, as gloo returns them
            return [_StagedWork(w, c, keep) for w, c in zip(works, copies)]
        # A coalesced batch: every receive lands once the batch's works are all done.
        return [_StagedWork(w, [pair for c in copies for pair in c] if i == len(works) - 1 else [], keep)
                for i, w in enumerate(works)]
    return staged_batch_p2p


@contextlib.contextmanager
def staged_p2p(enabled: bool = True, *, stage_all: bool = False) -> Iterator[None]:
    """While inside, pipeline schedules send and receive device tensors through host copies.

    ``stage_all`` stages CPU tensors too (through a fresh host buffer), which lets the
    rewriting be checked on CPU ranks against unstaged p2p.
    """
    if not enabled:
        yield
        return
    original = _schedules._batch_p2p
    _schedules._batch_p2p = _staging(original, stage_all)
    try:
        yield
    finally:
        _schedules._batch_p2p = original


def needs_staging(device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """True for a gloo pipeline group on a GPU: gloo's send/recv cannot take CUDA tensors."""
    return device.type == "cuda" and group is not None and dist.get_backend(group) == "gloo"


def _selftest(rank: int, port: int) -> None:
    import os

    from kernels.model.gpt import GPTConfig, loss_fn
    from kernels.parallel.pipeline import build_pipeline, pipeline_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = GPTConfig(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for staged in (False, True):
        rt = build_pipeline(cfg, "1f1b", rank, 2, 1, 2, dist.group.WORLD, torch.device("cpu"), loss_fn)
        with staged_p2p(stage_all=staged):
            losses.append(pipeline_step(rt, x, x))
    if rank == 1:
        print("unstaged loss", float(losses[0]), "staged loss", float(losses[1]))
    dist.destroy_process_group()


if __name__ == "__main__":
    from kernels.engine.run_alone import spawn_with_port

    spawn_with_port(_selftest, 2)
