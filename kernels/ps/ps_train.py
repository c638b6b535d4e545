"""Parameter-server training on the pool's ranks: ranks 0..servers-1 serve shards, the others are workers.

Algorithm: see ``kernels.ps.parameter_server`` (Li et al., OSDI 2014). Every rank builds the
same model from the seed (``kernels.model.family.build_model``); each server keeps the parameters
``split_by_bytes`` gives it and an optimizer over them. Worker w (rank servers + w) trains
step t on its share of step t's global batch (``kernels.train.batches.BatchStream`` with
dp = workers, dp_rank = w), exactly the batch a DDP rank w would see. Each step it:

1. pulls every shard (``rpc_async`` of ``pull_shard`` on its server) and copies it into its model;
2. computes the loss and gradients (a ``lab.Slow`` fault paces this, ``kernels.watch.faults``);
3. pushes each shard's gradients to its server and waits for the replies, which carry the
   version after the update (so staleness is known on both sides).

Servers answer calls on TensorPipe's threads while their main thread waits for every
worker's ``finish_shard``. A worker that raises calls ``abort_shard`` on every server first:
the server then answers every held push with the reason, so no worker waits for the
failed one, and its own main thread raises too. Every wait polls in short sleeps, so
when a rank dies outright the lab's interrupt ends the others' waits.

Each rank publishes what it is doing (``kernels.ps.ps_watch``), so a run that stops moving
is diagnosed as a training run is (``lab.HangError`` after ``hang_after``).

Records per rank (``kernels.contract.records``): a worker's losses, pulls, pushes, bytes, time
waiting and computing, staleness and timeline events; a server's load.

Run alone (4 processes on this machine, 1 server + 3 workers, sync, beside the reference)::

    python -m kernels.ps.ps_train
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from kernels.watch import faults as fault_kinds
from kernels.engine import runtime
from kernels.ps import ps_rpc
from kernels.parallel import warm_meshes
from kernels.watch import progress
from kernels.train.batches import BatchStream
from kernels.train.data import dataset
from kernels.model.family import build_model, model_config, model_loss
from kernels.watch.collective_log import CollectiveLog
from kernels.ps.parameter_server import ShardServer, split_by_bytes
from kernels.ps.ps_watch import PUSH_GROUP, logged_barrier, ps_watch
from kernels.contract.ps_records import PSSpan
from kernels.contract.run_config import RunConfig
from kernels.contract.strategy import resolve_strategy

PEER_FAILED = "a peer rank failed"  # lab.pool.supervise counts errors naming it as collateral, not as the cause
ABORT_TIMEOUT_S = 5.0  # a failing worker tells the servers; one that is gone already does not answer
_local_server: ShardServer | None = None  # this rank's shard while it serves; the RPC functions below reach it


def _shard() -> ShardServer:
    if _local_server is None:
        raise RuntimeError(f"rank {dist.get_rank()} serves no parameter shard")
    return _local_server


def pull_shard(worker: int, step: int) -> tuple[int, dict[str, torch.Tensor], bool]:
    """RPC, run on a server: this shard's version and parameters, and whether ``worker`` must stop before ``step``."""
    return _shard().pull(worker, step)


@rpc.functions.async_execution
def push_shard(worker: int, read: int, grads: dict[str, torch.Tensor]) -> torch.futures.Future:
    """RPC, run on a server: apply (or hold) the gradients; the reply comes when they are applied."""
    return _shard().push(worker, read, grads)


def finish_shard(worker: int) -> None:
    """RPC, run on a server: ``worker`` has pushed its last step."""
    _shard().finish(worker)


def abort_shard(worker: int, why: str) -> None:
    """RPC, run on a server: ``worker`` failed; the server stops and answers its held pushes with the reason."""
    _shard().fail(RuntimeError(f"parameter server rank {dist.get_rank()} stopped: {PEER_FAILED} "
                               f"(rank {worker}: {why})"))


def ps_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Serve or work per ``cfg`` (``lab.ps.parameter_server.ParameterServer.rank_config``); returns this rank's record."""
    global _local_server
    rank, world = dist.get_rank(), dist.get_world_size()
    run, servers = RunConfig.from_options(cfg["run"]), int(cfg["servers"])
    link = cfg["rpc"]
    # With earlier layouts' meshes kept warm (their gloo groups alive), workers' RPC replies stalled now
    # and then (from 20 s up to a hang; the cause is not pinned down). The parameter server uses no mesh:
    # the pool lets them go first, on every rank alike.
    warm_meshes.release_all()
    ps_rpc.start_rpc(rank, world, link["master_addr"], link["port"], link["bind_addrs"][rank], link["timeout_s"])
    try:
        model = build_model(model_config(run))
        sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        shards = split_by_bytes(sizes, servers)
        if rank < servers:
            named = dict(model.named_parameters())
            _local_server = ShardServer(rank, {n: named[n] for n in shards[rank]}, run, cfg["mode"],
                                        list(range(servers, world)), cfg["max_staleness"])
        with ps_watch(rank, fault_kinds.faults_for(cfg["faults"], rank)) as log:
            dist.barrier()  # every shard exists before any worker asks for one
            out = _serve(_local_server, log) if rank < servers else _work(run, model, shards, cfg, rank, servers, log)
            logged_barrier(log)  # every call has been answered on every rank: nothing is in flight
            log.finish()
        ps_rpc.stop_rpc(graceful=False)  # see ps_rpc.stop_rpc: RPC's own graceful stop cannot follow a replaced engine
        return {**out, "shards": shards}
    except BaseException as error:
        try:
            if _local_server is not None:
                _local_server.fail(RuntimeError(f"parameter server rank {rank} stopped: {error}"))
            else:
                _tell_servers(servers, rank, error)
        finally:  # a second interrupt while telling the servers must not leave the agent running
            ps_rpc.stop_rpc(graceful=False)
        raise
    finally:
        _local_server = None


def _tell_servers(servers: int, rank: int, error: BaseException) -> None:
    """Best effort: every server stops and releases the workers it holds, so nobody waits for this rank."""
    if PEER_FAILED in str(error):  # a server told us: it knows already
        return
    why = f"{type(error).__name__}: {error}"[:500]
    calls = [rpc.rpc_async(ps_rpc.rpc_name(s), abort_shard, args=(rank, why), timeout=ABORT_TIMEOUT_S)
             for s in range(servers)]
    for call in calls:
        try:
            ps_rpc.wait(call)
        except Exception:  # that server has stopped already
            pass


def _serve(server: ShardServer, log: CollectiveLog) -> dict[str, Any]:
    """The main thread waits until every worker is done; TensorPipe's threads do the serving meanwhile.

    Server 0 alone takes a stop request (``kernels.watch.progress.STOP_SIGNAL``, sent by
    ``lab.ps.ps_handle.PSHandle.stop``): the workers read it in its pull replies.
    """
    stop_asked = progress.stop_asked if server.rank == 0 else (lambda: False)
    shown: list[int] | None = None

    def poll() -> bool:  # on this main thread, between waits: the log has one writer
        nonlocal shown
        with server.lock:  # workers finish on RPC threads
            training = sorted(set(server.workers) - server.finished)
        if training != shown:
            shown = training
            log.act(f"serving {len(server.params)} parameters; "
                    + (f"workers {training} still training" if training else "every worker finished"))
        return stop_asked()

    server.wait_done(poll)
    return {"role": "server", "rank": server.rank, **server.record()}


def _work(run: RunConfig, model: torch.nn.Module, shards: list[list[str]], cfg: dict[str, Any], rank: int,
          servers: int, log: CollectiveLog) -> dict[str, Any]:
    """Pull, compute, push for every step (each published to ``log``); then tell the servers this worker is done."""
    workers = dist.get_world_size() - servers
    device = runtime.rank_device()
    mine = fault_kinds.faults_for(cfg["faults"], rank)
    pacing = fault_kinds.pacing_for(mine, None)
    params = dict(model.named_parameters())
    loss_fn = model_loss(model_config(run))
    names = [ps_rpc.rpc_name(s) for s in range(servers)]
    stats = {"pulls": 0, "pushes": 0, "bytes_sent": 0, "bytes_received": 0, "wait_s": 0.0, "compute_s": 0.0}
    losses, staleness, events, notes = [], [], [], []
    batches = BatchStream(dataset(run), steps=run.steps, global_batch=run.global_batch, dp_rank=rank - servers,
                          dp=workers, device=device)
    every_worker = tuple(range(servers, dist.get_world_size()))
    for step, (inputs, targets) in enumerate(batches):
        log.begin_step(step)
        for fault in mine:
            fault_kinds.strike(fault, step, lambda text: (notes.append(text), log.note_fault(text)))
        log.act(f"pull, step {step}")
        began = time.time()
        reads = [rpc.rpc_async(name, pull_shard, args=(rank, step)) for name in names]
        versions, stop = [], False
        with torch.no_grad():
            for s, future in enumerate(reads):
                version, values, told_to_stop = ps_rpc.wait(future)
                versions.append(version)
                stop = stop or (s == 0 and told_to_stop)  # server 0 decides for every worker
                for name, value in values.items():
                    params[name].copy_(value)
                    stats["bytes_received"] += value.numel() * value.element_size()
        stats["pulls"] += servers
        if stop:
            break
        pulled = time.time()
        log.act(f"compute, step {step}")
        loss = _gradients(model, loss_fn, inputs, targets, pacing)
        computed = time.time()
        # A parameter this share did not reach (an expert no token was routed to) has no gradient to push.
        grads = [{n: params[n].grad for n in shard if params[n].grad is not None} for shard in shards]
        nbytes = sum(g.numel() * g.element_size() for shard in grads for g in shard.values())
        stats["bytes_sent"] += nbytes
        token = log.enter("push", PUSH_GROUP, every_worker, nbytes)
        replies = [rpc.rpc_async(name, push_shard, args=(rank, versions[s], grads[s])) for s, name in enumerate(names)]
        after = [ps_rpc.wait(future) for future in replies]
        log.leave(token)
        stats["pushes"] += servers
        model.zero_grad(set_to_none=True)
        pushed = time.time()
        staleness += [v - 1 - read for v, read in zip(after, versions)]  # the reply is the version after the update
        stats["wait_s"] += (pulled - began) + (pushed - computed)
        stats["compute_s"] += computed - pulled
        events += [PSSpan(rank, kind, step, a, b).to_dict()
                   for kind, a, b in (("pull", began, pulled), ("compute", pulled, computed), ("push", computed, pushed))]
        losses.append(loss)
    for call in [rpc.rpc_async(name, finish_shard, args=(rank,)) for name in names]:
        ps_rpc.wait(call)
    log.act(f"finished after {len(losses)} steps")
    return {"role": "worker", "rank": rank, "losses": losses, "staleness": staleness, "events": events,
            "notes": notes, **stats}


def _gradients(model: torch.nn.Module, loss_fn: Callable, inputs: torch.Tensor, targets: torch.Tensor,
               pacing: fault_kinds.Pacing) -> float:
    """Forward and backward on this worker's share; a slow rank's compute is stretched by its factor."""
    began = time.perf_counter()
    logits = model(inputs)  # (B/workers, T, vocab)
    forward_s = pacing.after_forward(began) if pacing.active else 0.0
    loss = loss_fn(logits, targets)
    if pacing.active:
        pacing.before_backward(forward_s)
    loss.backward()
    return loss.item()


def _selftest(rank: int, world: int, port: int, rpc_port_box: Any) -> None:
    runtime.join_world({"rank": rank, "world_size": world, "backend": "gloo", "device": "cpu",
                        "master_addr": "127.0.0.1", "port": port, "bind_addr": "127.0.0.1", "threads": 1,
                        "timeout_s": 60})
    if rank == 0:
        rpc_port = ps_rpc.open_rpc_store("127.0.0.1", world, 60)
        for _ in range(world - 1):
            rpc_port_box.put(rpc_port)
    else:
        rpc_port = rpc_port_box.get()
    run = RunConfig(model={"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16},
                    strategy=resolve_strategy(dp=world - 1), steps=3, global_batch=6)
    out = ps_rank({"run": run.to_dict(), "servers": 1, "mode": "sync", "max_staleness": None, "faults": [],
                   "rpc": {"master_addr": "127.0.0.1", "port": rpc_port, "bind_addrs": ["127.0.0.1"] * world,
                           "timeout_s": 60}})
    mine = torch.tensor(out.get("losses", [0.0] * run.steps))  # servers add nothing
    dist.all_reduce(mine)  # the workers' losses summed per step
    if rank == 0:
        from kernels.train.reference import train_reference
        print("PS mean loss:", [round(v / (world - 1), 5) for v in mine.tolist()])
        print("reference   :", [round(v, 5) for v in train_reference(run)["losses"]])
    runtime.leave_world()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    box = ctx.Queue()
    store_port = runtime.open_store("127.0.0.1", 4, 60)
    peers = [ctx.Process(target=_selftest, args=(r, 4, store_port, box)) for r in (1, 2, 3)]
    for p in peers:
        p.start()
    _selftest(0, 4, store_port, box)
    for p in peers:
        p.join()
