"""torch.distributed.rpc beside the process group: its own rendezvous store, start and stop on a warm pool.

The parameter server (``kernels.ps.parameter_server``) talks through ``torch.distributed.rpc``
(TensorPipe agent), which needs a rendezvous of its own. As with the process group
(``kernels.engine.runtime``), no fixed port is used: the driver first calls :func:`open_rpc_store`
on rank 0, which binds a ``TCPStore`` to a port the OS picks on the listen address, then
every rank calls :func:`start_rpc` with that port. ``init_rpc`` only takes a URL, so the
store reaches it through a rendezvous scheme of our own (``labrpc://``) registered with
``torch.distributed.rendezvous``. TensorPipe listens on the interface named by
``TP_SOCKET_IFNAME``, set to the one holding the listen address, like gloo's.

:func:`stop_rpc` ends the agent, so that the next run (or an ordinary ``Experiment``) finds the
engine without one and can start a new one. The parameter server stops it locally after a
barrier of its own (why not RPC's graceful stop: :func:`stop_rpc`).

Run alone (two processes start RPC twice, call each other, stop)::

    python -m kernels.ps.ps_rpc
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
from torch.distributed.rendezvous import register_rendezvous_handler

from kernels.engine import runtime

_SCHEME = "labrpc"
_store: dist.Store | None = None  # rank 0's master store, from open_rpc_store until start_rpc hands it to the agent


def _rendezvous(url: str, **kwargs: Any):
    # init_rpc's rendezvous: rank 0 brings the store open_rpc_store made; the others connect to it.
    global _store
    parsed = urlparse(url)
    query = dict(item.split("=") for item in parsed.query.split("&"))
    rank, world, timeout = int(query["rank"]), int(query["world_size"]), float(query["timeout"])
    store = _store if rank == 0 else dist.TCPStore(parsed.hostname, parsed.port, world, is_master=False,
                                                     timeout=timedelta(seconds=timeout))
    _store = None
    yield store, rank, world


register_rendezvous_handler(_SCHEME, _rendezvous)


def rpc_name(rank: int) -> str:
    """The RPC worker name of process-group rank ``rank``."""
    return f"rank{rank}"


def open_rpc_store(bind_addr: str, world_size: int, timeout_s: float) -> int:
    """On rank 0: a rendezvous store for RPC on a free port of ``bind_addr`` only; returns the port."""
    global _store
    _store = runtime.bound_master_store(bind_addr, world_size, timeout_s)
    return _store.port


def start_rpc(rank: int, world_size: int, master_addr: str, port: int, bind_addr: str, timeout_s: float) -> None:
    """Join the RPC group as ``rank{rank}``; calls time out after ``timeout_s``.

    An agent still set from an earlier run is stopped first: an interrupt that lands while a run
    stops its agent (SIGINT after a peer died) can leave it set, and ``init_rpc`` would refuse.
    """
    _drop_leftover_agent()
    os.environ["TP_SOCKET_IFNAME"] = runtime.interface_of(bind_addr)
    url = f"{_SCHEME}://{master_addr}:{port}?timeout={timeout_s}"  # init_rpc appends rank and world_size
    options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout_s, num_worker_threads=8)
    if dist.is_initialized():  # on the pool; a script without a process group starts its processes afresh
        _agree_on_rpc_counts(world_size)
    rpc.init_rpc(rpc_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


def _drop_leftover_agent() -> None:
    if not rpc_api._is_current_rpc_agent_set():
        return
    try:
        rpc.shutdown(graceful=False)
    except Exception:  # an agent shut down before its reset was interrupted: only the reset is left
        rpc_api._cleanup_python_rpc_handler()
        rpc_api._reset_current_rpc_agent()


def _agree_on_rpc_counts(world_size: int) -> None:
    # Two private per-process counters must agree across the ranks, or RPC waits for ever:
    # init_rpc keys its rendezvous under "rpc_prefix_<n>" (n: this process's earlier init_rpc calls),
    # and rpc's own all-gather (in init_rpc) numbers its rounds per set of
    # worker names. An engine the lab replaced after a failure starts both at 0 while the others go
    # on counting, so before each start every rank takes the largest of each.
    names = "".join(sorted(rpc_name(r) for r in range(world_size)))  # rpc.api._all_gather's key
    with rpc._init_counter_lock, rpc_api._all_gather_dict_lock:
        counts = torch.tensor([rpc._init_counter, rpc_api._all_gather_sequence_id.get(names, 0)])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        rpc._init_counter = int(counts[0])
        rpc_api._all_gather_sequence_id[names] = int(counts[1])


def wait(future: torch.futures.Future, poll_s: float = 0.002) -> Any:
    """``future.wait()`` in short sleeps, raising what the remote call raised.

    Short sleeps: a wait inside torch does not end on SIGINT, an interrupt must. Raising: an
    ``async_execution`` function whose future ends with ``set_exception`` reaches the caller as the
    exception object *returned* (torch 2.13), not raised, unlike an ordinary function that raises.
    """
    while not future.done():
        time.sleep(poll_s)
    result = future.wait()
    if isinstance(result, BaseException):
        raise result
    return result


def stop_rpc(*, graceful: bool) -> None:
    """Stop this rank's agent (no-op without one); ``graceful`` waits for every rank's outstanding calls.

    The parameter server stops with ``graceful=False`` after a gloo barrier instead: a graceful stop
    meets the other ranks under keys numbered by a counter inside torch's C++ agent, per process,
    which an engine the lab replaced restarts at 0 (and cannot be read from Python), so it would wait
    for the timeout after a worker was killed once.
    """
    global _store
    _store = None
    if rpc_api._is_current_rpc_agent_set():
        rpc.shutdown(graceful=graceful)


def _echo(text: str) -> str:
    return f"{text} from {rpc.get_worker_info().name}"


def _selftest(rank: int, port: int) -> None:
    for attempt in range(2):  # the second start proves the agent can be started again after a stop
        if rank == 0 and attempt:
            port = open_rpc_store("127.0.0.1", 2, 30)
            port_box.put(port)
        elif attempt:
            port = port_box.get()
        start_rpc(rank, 2, "127.0.0.1", port, "127.0.0.1", 30)
        print(rpc.rpc_sync(rpc_name(1 - rank), _echo, args=(f"hello {attempt} to rank{1 - rank}",)), flush=True)
        stop_rpc(graceful=True)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    port_box = ctx.Queue()
    first = open_rpc_store("127.0.0.1", 2, 30)
    peer = ctx.Process(target=_selftest, args=(1, first))
    peer.start()
    _selftest(0, first)
    peer.join()
