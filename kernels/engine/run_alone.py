"""``spawn_with_port``: how a rank-side module runs alone, on a few local gloo processes, without the lab.

A module's self-test (``python -m kernels.parallel.ring_attention``) spawns its ranks with torch's own
``torch.multiprocessing.spawn``; each rank builds its process group on the loopback port this picks.
"""
from __future__ import annotations

import socket
from typing import Any, Callable


def free_port() -> int:
    """A TCP port nothing on this host listens on now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_with_port(fn: Callable[..., Any], nprocs: int, *args: Any) -> None:
    """Run ``fn(rank, port, *args)`` on ``nprocs`` processes that meet at a free loopback ``port``."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(free_port(), *args), nprocs=nprocs)
