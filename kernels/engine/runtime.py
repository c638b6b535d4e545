"""Rank runtime: one engine's view of the world (process group, device, threads).

The driver calls these functions on every engine, in two phases, to build a
``torch.distributed`` world without any fixed port:

1. ``open_store`` on rank 0 only: a c10d ``TCPStore`` on a free port of rank 0's
   host (port 0 lets the OS choose, so two pools never race for a port).
2. ``join_world`` on every rank: ``init_process_group`` over that store, then one
   ``all_reduce`` of the ranks' ids to prove that every rank is connected.

Nothing listens beyond the address the driver names (``bind_addr``: loopback when
every rank is on one host). A bare ``TCPStore`` listens on every interface, so rank 0
hands it a socket already bound to that address; gloo (and NCCL) listen on the
interface named by ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``), which
``join_world`` sets to the interface holding that address before any group exists,
so the mesh's sub-groups stay there too.

``call_guarded`` wraps every user function the driver sends. A function from the
notebook arrives with the notebook's globals (the driver ships it with cloudpickle);
names the notebook does not define (``rank``, ``device``, names pushed to the ranks)
are looked up in this rank's namespace, where ``%%px`` cells find them. When the function
raises (or is interrupted), the guard destroys this rank's process group before it
re-raises. With gloo, closing a rank's connections makes every peer that waits on it
in a collective fail at once with "Connection closed by peer", instead of waiting
for the collective timeout: that is what lets the driver report the failing rank
within seconds and rebuild the world. Its frame on a rank's stack is how the driver tells
that the rank has begun a call (``lab.pool.cluster_world``).

Run alone (two ranks, no ipyparallel)::

    python -m kernels.engine.runtime
"""
from __future__ import annotations

import gc
import importlib
import os
import socket
import sys
import traceback
import types
import weakref
from datetime import timedelta
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from kernels.engine.long_lived import thaw
from kernels.watch import flight_recorder, stack_report

# These torch modules give functions the default argument ``group=dist.group.WORLD``, which
# Python evaluates once, at the module's first import. Imported while a world exists (training
# imports them lazily), they would hold that world's process group for good, and with it its
# gloo connections: a failing rank's leave_world() would then close nothing, and its peers would
# wait in their collective until the timeout instead of failing at once. describe_engine, the
# first call on every engine, imports them before any world, so the defaults hold None.
_MODULES_WITH_WORLD_DEFAULTS = ("torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer",
                                "torch.distributed.fsdp.sharded_grad_scaler")

# The master store must outlive the call that created it until rank 0 joins the
# world in the next call; after that the process group holds its own reference.
_master_store: dist.TCPStore | None = None
# The device this rank computes on, from the rank map: a GPU of its own (NCCL), a shared GPU
# (gloo with CUDA tensors) or the CPU. None until join_world runs (e.g. under torchrun).
_rank_device: torch.device | None = None
_left_groups: list[weakref.ref] = []  # the groups the last leave_world() destroyed
_on_leave: list[Callable[[], Any]] = []  # what holds groups of the world (kernels.train.live_training): freed first


def describe_engine(controller_host: str) -> dict[str, Any]:
    """Report this engine's host, reachable address, pid, visible GPUs and cores.

    ``controller_host`` is only used to find which local address routes to the
    controller, which is the address other hosts can reach this engine on. The engine is
    also armed to report its stack on the driver's signal (``kernels.watch.stack_report``), and
    imports the torch modules that would otherwise pin a world (``_MODULES_WITH_WORLD_DEFAULTS``).
    """
    stack_report.arm()
    for name in _MODULES_WITH_WORLD_DEFAULTS:
        importlib.import_module(name)
    return {
        "host": socket.gethostname(),
        "ip": _routable_ip(controller_host),
        "pid": os.getpid(),
        "gpus": list(_visible_gpus()),
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def _routable_ip(peer_host: str) -> str:
    if peer_host in ("127.0.0.1", "localhost", "::1", ""):
        return "127.0.0.1"
    # A UDP connect sends nothing; it only asks the kernel which interface routes to the peer.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _visible_gpus() -> tuple[str, ...]:
    if not torch.cuda.is_available():
        return ()
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        ids = tuple(x.strip() for x in listed.split(",") if x.strip())
        return ids[:count]
    return tuple(str(i) for i in range(count))


def bound_master_store(bind_addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A master ``TCPStore`` on a port the OS picks, listening on ``bind_addr`` only (a bare one listens everywhere)."""
    family = socket.getaddrinfo(bind_addr, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((bind_addr, 0))  # port 0: the OS picks a free one
        listener.listen()
        store = dist.TCPStore(bind_addr, listener.getsockname()[1], world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the descriptor now and closes it when it goes
    return store


def open_store(bind_addr: str, world_size: int, timeout_s: float) -> int:
    """Start the rendezvous store on rank 0, listening on ``bind_addr`` only, and return its port."""
    global _master_store
    _master_store = bound_master_store(bind_addr, world_size, timeout_s)
    return _master_store.port


def join_world(spec: dict[str, Any]) -> dict[str, Any]:
    """Join the process group described by ``spec`` and prove it with an all_reduce.

    ``spec`` keys: rank, world_size, backend, device, master_addr, port, bind_addr
    (the address this rank's sockets listen on), threads, timeout_s (collective
    timeout). Any process group this engine held before is destroyed first, so
    calling this again rebuilds the world.
    """
    global _master_store, _rank_device
    leave_world()
    _listen_only_on(spec["bind_addr"])
    torch.set_num_threads(int(spec["threads"]))
    _rank_device = torch.device(spec["device"])
    if spec["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(spec["device"]))
    rank, world = int(spec["rank"]), int(spec["world_size"])
    timeout = timedelta(seconds=float(spec["timeout_s"]))
    store = _master_store if rank == 0 else dist.TCPStore(
        spec["master_addr"], int(spec["port"]), world, is_master=False, timeout=timeout)
    flight_recorder.enable()  # read when the group is made: hang reports use torch's own record
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world,
                            timeout=timeout, device_id=bound_device(spec["backend"], spec["device"]))
    _master_store = None
    probe = torch.tensor([float(rank)], device=spec["device"])
    dist.all_reduce(probe)
    expected = world * (world - 1) / 2
    if probe.item() != expected:
        raise RuntimeError(f"rank {rank}: all_reduce check gave {probe.item()}, expected {expected}")
    return {"rank": rank, "threads": torch.get_num_threads(), "pid": os.getpid()}


def rank_device() -> torch.device:
    """The device this rank computes on: the rank map's, or under torchrun its GPU with NCCL, else the CPU."""
    if _rank_device is not None and dist.is_initialized():
        return _rank_device
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _listen_only_on(addr: str) -> None:
    # By default gloo listens on the address the hostname resolves to, which may be a
    # public one, and NCCL on the first non-loopback interface. gloo reads its variable
    # for every group it creates, NCCL when it first starts ("=": an exact name, not a prefix).
    name = interface_of(addr)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = "=" + name


def interface_of(addr: str) -> str:
    """The name of this host's network interface that holds ``addr`` (``lo`` for 127.0.0.1 on Linux)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    raise RuntimeError(f"no network interface of {socket.gethostname()} holds the address {addr}")


def bound_device(backend: str, device: str) -> torch.device | None:
    """The ``device_id`` a rank's world is bound to: its GPU under NCCL (which then connects eagerly), else none.

    DeviceMesh splits its groups from a bound world, deep-copying the backend's options, which
    torch 2.11 cannot do for gloo ("cannot pickle '_Options'"): gloo ranks on a shared GPU stay unbound."""
    return torch.device(device) if backend == "nccl" and device.startswith("cuda") else None


def leave_world() -> bool:
    """Destroy this engine's process groups (all of them) and free them; True if one existed.

    A gloo group closes its connections only when the group object itself is freed, and
    torch keeps groups reachable past ``destroy_process_group``: a failed collective's
    frames hold its group, and every DeviceMesh holds its groups, while DTensor's caches
    (sharding propagation, redistribution planners, mesh topology) keep the meshes of
    earlier runs alive, as may the user's own variables. So if a group survives its
    destruction, reference cycles are collected, and if one survives even that, it is
    dropped from every mesh still alive. :func:`lingering_groups` says whether any
    group survived all of it.
    """
    global _left_groups
    if not dist.is_initialized():
        return False
    from torch.distributed import distributed_c10d as c10d  # its group table is private

    for release in _on_leave:
        release()
    _left_groups = [weakref.ref(group) for group in c10d._world.pg_map]
    dist.destroy_process_group()
    if lingering_groups():
        thaw()  # a group held in long-lived cycles (kernels.engine.long_lived) is freed only this way
        gc.collect()
    if lingering_groups():  # scanning every object costs a few tenths of a second: only when needed
        for mesh in (o for o in gc.get_objects() if isinstance(o, DeviceMesh)):
            getattr(mesh, "_pg_registry", {}).clear()  # private: the mesh's name -> group table
        gc.collect()
    return True


def on_leave_world(release: Callable[[], Any]) -> None:
    """Call ``release()`` at the start of every :func:`leave_world`, while the world's groups still exist."""
    _on_leave.append(release)


def lingering_groups() -> int:
    """How many of the groups the last :func:`leave_world` destroyed are still alive (their connections open)."""
    return sum(ref() is not None for ref in _left_groups)


def call_guarded(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run ``fn(*args, **kwargs)``; on any failure, leave the world, then re-raise.

    Leaving the world closes this rank's connections, so peers blocked in a
    collective with it fail fast rather than hang until the collective timeout.
    The failure's frames are kept for the driver (``kernels.watch.stack_report.last_failure``).
    """
    stack_report.forget_failure()
    try:
        return _with_rank_names(fn)(*args, **kwargs)
    except BaseException as error:
        stack_report.record_failure(error)
        # The failed collective's frames hold the process group; clearing their
        # locals lets it be freed (and its sockets closed) now, not when IPython
        # drops its reference to the last traceback.
        _clear_chain(error)
        leave_world()
        raise


def _with_rank_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    # cloudpickle rebuilds a notebook function (and the notebook functions it calls) on
    # a fresh globals dict holding only what it read in the notebook; the rank's own
    # names fill the gaps, and the notebook's values win where both define a name.
    here = vars(sys.modules["__main__"])  # the engine's namespace: push and %%px write here
    if isinstance(fn, types.FunctionType) and fn.__module__ == "__main__" and fn.__globals__ is not here:
        for name, value in here.items():
            fn.__globals__.setdefault(name, value)
    return fn


def _clear_chain(error: BaseException | None) -> None:
    # A KeyboardInterrupt raised as a failed collective returns carries that
    # failure as its context, whose frames hold the group too.
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _selftest(rank: int, world: int, port: int) -> None:
    join_world({"rank": rank, "world_size": world, "backend": "gloo", "device": "cpu", "master_addr": "127.0.0.1",
                "port": port, "bind_addr": "127.0.0.1", "threads": 1, "timeout_s": 30})
    print(f"rank {rank}/{world} joined and verified")
    leave_world()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    port = open_store("127.0.0.1", 2, 30)
    # Rank 0 must live in the process that owns the store, so it runs here.
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_selftest, args=(1, 2, port))
    peer.start()
    _selftest(0, 2, port)
    peer.join()
