"""The torch.distributed functions the lab watches, by name: what each one is, and a way to wrap them all.

``DIST_OPS`` maps a function's name in the ``torch.distributed`` namespace to the op it
performs and the payload it carries (as nccl-tests counts it: ``kernels.watch.comm``);
``patched_dist_names`` swaps the namespace's functions for wrapped ones while a probe is
active. The communication meter (``kernels.watch.comm``) and the collective log
(``kernels.watch.rank_watch``) both wrap through it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements."""
    return t.numel() * t.element_size()


def _sum_bytes(ts: Any) -> int:
    return sum(tensor_bytes(t) for t in ts)


# name in torch.distributed -> (op name, payload bytes from the bound arguments)
DIST_OPS: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "all_reduce": ("all_reduce", lambda a: tensor_bytes(a["tensor"])),
    "all_gather_into_tensor": ("all_gather", lambda a: tensor_bytes(a["output_tensor"])),
    "all_gather_single": ("all_gather", lambda a: tensor_bytes(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a: _sum_bytes(a["tensor_list"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: tensor_bytes(a["input"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: tensor_bytes(a["input"])),
    "reduce_scatter": ("reduce_scatter", lambda a: _sum_bytes(a["input_list"])),
    "broadcast": ("broadcast", lambda a: tensor_bytes(a["tensor"])),
    "all_to_all_single": ("all_to_all", lambda a: tensor_bytes(a["input"])),
    "send": ("send", lambda a: tensor_bytes(a["tensor"])),
    "recv": ("recv", lambda a: tensor_bytes(a["tensor"])),
    "isend": ("send", lambda a: tensor_bytes(a["tensor"])),
    "irecv": ("recv", lambda a: tensor_bytes(a["tensor"])),
}
P2P = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


@contextlib.contextmanager
def patched_dist_names(names: list[str], wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """While active, each ``torch.distributed.<name>`` in ``names`` is ``wrap(name, original)``; restored after.

    Only the namespace attribute changes: callers that imported a function, or call c10d's
    own module, reach the original (the lab's own bookkeeping collectives rely on that).
    """
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    for n, fn in originals.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
