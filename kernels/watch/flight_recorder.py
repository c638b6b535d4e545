"""torch's own flight recorder on a rank, summed up per process group, and sent to the driver while the rank trains.

c10d keeps a ring buffer of every collective each process group ran (its op, its sequence
number in that group, its sizes, and whether it has finished), on NCCL and, since torch
2.7, on gloo too. It is on when ``TORCH_FR_BUFFER_SIZE`` is set before the first process
group of the process is made: ``kernels.engine.runtime.join_world`` sets it (``enable``) unless
the user did.

``group_summaries`` reads the buffer (``_dump_fr_trace`` without stack traces) and keeps,
per process group, its last collective and the last one that finished: what a hang
diagnosis needs, small enough to send.

``WatchBeacon`` is a thread that, while a run is watched (``kernels.watch.rank_watch``), sends
this rank's collective-log state through ipyparallel's engine-to-client data channel (key
``watch``) whenever it changed, every half second at most, and once the state has not
changed for a second, the flight-recorder summary with it. A rank blocked in a collective
still sends: the backends release the GIL while they wait. So the driver knows what ranks
on other hosts are doing, where it cannot read their state files.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any, Callable

import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch.distributed import distributed_c10d

from kernels.watch.collective_log import BEACON_KEY
from kernels.watch.state_file import read_state
from kernels.watch.progress import engine_publisher
from kernels.contract.watch_records import FlightGroup

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
BUFFER_ENTRIES = "500"  # several steps of the lab's layouts (a TP×FSDP step makes ~50); a dump reads them all


def enable() -> None:
    """Turn torch's flight recorder on for the process groups made from now on (the user's size wins)."""
    os.environ.setdefault(BUFFER_ENV, BUFFER_ENTRIES)


def _dump() -> dict[str, Any] | None:
    dump = getattr(c10d, "_dump_fr_trace", None)  # absent from builds without the recorder
    if dump is None:
        return None
    return pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=False))


def _group_ranks() -> dict[str, tuple[int, ...]]:
    """Each live process group's name (as the flight recorder names it) -> its global ranks."""
    return {distributed_c10d._get_process_group_name(pg): tuple(dist.get_process_group_ranks(pg))
            for pg in list(distributed_c10d._world.pg_map)}


def mesh_axis_names(meshes: list[Any]) -> dict[str, str]:
    """Each mesh axis's process-group name -> the axis ("dp", "tp", "pp"), for ``meshes`` (None entries skipped)."""
    names: dict[str, str] = {}
    for mesh in meshes:
        if mesh is None or mesh.mesh_dim_names is None:
            continue
        for axis in mesh.mesh_dim_names:
            names.setdefault(distributed_c10d._get_process_group_name(mesh.get_group(axis)), axis)
    return names


def group_summaries(axis_names: dict[str, str] | None = None, since_ns: int = 0) -> tuple[FlightGroup, ...]:
    """Per process group: its last collective in the flight recorder, and the last one that finished.

    ``axis_names`` maps a group's name to its mesh axis ("dp", "tp", ...). Only entries
    made from ``since_ns`` (``time.time_ns()``) on count: the recorder outlives the groups,
    and a rebuilt world reuses their names. Point-to-point
    entries (a pipeline's send/recv) are left out: they have no group-wide sequence.
    Empty when the recorder is off or this torch has none.
    """
    dump = _dump() if dist.is_initialized() else None
    if not dump:
        return ()
    ranks, names = _group_ranks(), axis_names or {}
    last: dict[str, dict[str, Any]] = {}
    done: dict[str, int] = {}
    for entry in dump.get("entries", ()):
        if entry.get("is_p2p") or not entry.get("collective_seq_id") or entry["time_created_ns"] < since_ns:
            continue
        name, seq = entry["process_group"][0], entry["collective_seq_id"]
        if name not in last or seq >= last[name]["collective_seq_id"]:
            last[name] = entry
        if entry.get("retired") or entry.get("state") == "completed":
            done[name] = max(done.get(name, 0), seq)
    return tuple(FlightGroup(group=name, axis=names.get(name, ""), ranks=ranks.get(name, ()),
                             last_seq=e["collective_seq_id"], last_op=e["profiling_name"],
                             last_done_seq=done.get(name, 0))
                 for name, e in sorted(last.items()))


def engine_beacon(state_path: str, axis_names: dict[str, str]) -> "WatchBeacon | None":
    """A beacon (not started) for this rank's state on an ipyparallel engine; None elsewhere, with nobody to send to."""
    publish = engine_publisher()
    return None if publish is None else WatchBeacon(state_path, publish, axis_names)


class WatchBeacon:
    """Sends this rank's state, and when it goes quiet its flight summary, to the driver (module docstring)."""

    def __init__(self, state_path: str, publish: Callable[[dict[str, Any]], None],
                 axis_names: dict[str, str], period_s: float = 0.5, quiet_s: float = 1.0) -> None:
        self._path, self._publish, self._names = state_path, publish, axis_names
        self._period, self._quiet = period_s, quiet_s
        self._since_ns = time.time_ns()
        self._stop = threading.Event()
        self._counter: int | None = -1
        self._changed_at = time.monotonic()
        self._flight_sent = False
        self._thread = threading.Thread(target=self._loop, name="cluster-lab-watch-beacon", daemon=True)

    def start(self) -> "WatchBeacon":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self.send()

    def send(self) -> None:
        """Publish the state if it changed; once it has not changed for ``quiet_s``, publish it with the flight summary.

        The recorder is read only for a quiet rank: a dump costs about 30 us per entry in
        its ring (tens of ms for a full one), too much to pay every half second while the
        rank trains, and only a rank that stopped moving needs explaining.
        """
        state = read_state(self._path)
        counter, now = (state.counter if state is not None else None), time.monotonic()
        flight = None
        if counter != self._counter:
            self._counter, self._changed_at, self._flight_sent = counter, now, False
        elif not self._flight_sent and now - self._changed_at >= self._quiet:
            flight, self._flight_sent = group_summaries(self._names, self._since_ns), True
        else:
            return
        self._publish({BEACON_KEY: {"state": state.to_dict() if state is not None else None,
                                    "flight": None if flight is None else [g.to_dict() for g in flight],
                                    "sent": time.time()}})

    def stop(self) -> None:
        """Stop before the call returns (its messages belong to this call), after sending the last state."""
        self._stop.set()
        self._thread.join()
        self.send()
