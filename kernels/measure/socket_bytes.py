"""Bytes this process has written so far, sockets included: a direct count of what a gloo collective sends.

Algorithm: Linux per-task I/O accounting (the kernel's Documentation/filesystems/proc.rst, "/proc/<pid>/io"):
``wchar`` counts the bytes the process passed to write-family system calls, whatever the file, so sockets too.
gloo's TCP transport sends with writev(2), so the growth of ``wchar`` around a collective is the bytes this
rank put on its sockets for it, message headers included. A ring all-reduce of P bytes on n ranks sends
2(n-1)/n · P from every rank (Patarasuk & Yuan, 2009, "Bandwidth optimal all-reduce algorithms for clusters
of workstations", J. Parallel Distrib. Comput. 69(2)); this count checks that without trusting the formula.
NCCL moves GPU buffers without the process's write calls, and systems without /proc have no such file:
there the count is None. Other writes of the process in the same interval (a log line) are counted too.

Run alone (all-reduces 1 MiB on 4 ranks; each rank prints the bytes it wrote beside 2(n-1)/n · P)::

    torchrun --nproc-per-node 4 -m kernels.measure.socket_bytes
"""
from __future__ import annotations

from pathlib import Path

_IO = Path("/proc/self/io")


def bytes_written() -> int | None:
    """``wchar`` of this process: bytes passed to write calls since it started; None where it is not kept."""
    try:
        text = _IO.read_text()
    except OSError:  # not Linux, or a kernel built without task I/O accounting
        return None
    for line in text.splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return None


if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n, payload = dist.get_world_size(), torch.ones(1 << 18)  # 1 MiB of fp32
    dist.all_reduce(payload)  # warm-up: connections set up outside the count
    before = bytes_written()
    dist.all_reduce(payload)
    after = bytes_written()
    sent = None if before is None or after is None else after - before
    print(f"rank {dist.get_rank()}: wrote {sent} B; ring 2(n-1)/n · P = {2 * (n - 1) / n * 4 * payload.numel():.0f} B")
    dist.destroy_process_group()
