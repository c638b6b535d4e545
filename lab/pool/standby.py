"""Standby engines: started beside an owned pool's ranks, warmed, and swapped in for a lost rank.

A fresh engine takes 3-4 s to be usable on an idle two-core machine, more under load (Python starts,
ipyparallel registers it, torch is imported), longer than anyone should wait to hear that
a rank died. So a pool the lab started keeps ``want`` spare engines registered with
torch already imported (``kernels.engine.runtime.describe_engine`` imports it and arms the
engine's stack report). When a rank's engine dies or has to be killed, recovery takes a
spare, which costs about a second, and launches a replacement spare that registers in
the background: ipyparallel starts engines without waiting for them. When more ranks
are lost than spares are ready, the rest wait for engines still starting.
"""
from __future__ import annotations

import time
from typing import Any

from ipyparallel import AsyncResult

from kernels.engine import runtime
from kernels.contract.pool_records import EngineInfo
from lab.pool import launch


def engine_info(engine_id: int, described: dict[str, Any]) -> EngineInfo:
    """An engine's ``runtime.describe_engine`` answer as a record."""
    d = described
    return EngineInfo(engine_id=engine_id, host=d["host"], ip=d["ip"], pid=d["pid"], gpus=tuple(d["gpus"]),
                      cpu_count=d["cpu_count"])


class Standby:
    """The spare engines of one owned pool: which are ready, and launching more."""

    def __init__(self, source: launch.EngineSource, want: int, controller_host: str) -> None:
        self._source = source
        self.want = want
        self._controller_host = controller_host
        self._warming: dict[int, AsyncResult] = {}  # engine id -> its describe_engine call
        self._ready: dict[int, EngineInfo] = {}  # warmed spares by engine id
        self._launched: set[int] = set()  # pids launched as spares, not yet ready
        self._retired: set[int] = set()  # engine ids never to hand out (former ranks, failed warm-ups)

    @property
    def ready(self) -> int:
        """Spares warmed and waiting."""
        return len(self._ready)

    def retire(self, engine_ids: set[int]) -> None:
        """Never hand these engines out (ranks whose engines died, were killed, or were stopped)."""
        self._retired |= set(engine_ids)

    def forget_all(self, engine_ids: set[int]) -> None:
        """After every engine was stopped (``Cluster.restart``): none of them is a spare any more."""
        self.retire(engine_ids)
        self._warming.clear()
        self._ready.clear()
        self._launched.clear()

    def launch(self, n: int) -> None:
        """Start ``n`` spare engines without waiting for them to register."""
        # A run's recovery on its own thread may still be replacing ranks when the pool is stopped under it.
        if n <= 0 or self._source.stopped:
            return
        cluster = self._source.ipp_cluster
        set_id = cluster.start_engines_sync(n)
        self._launched |= launch.engine_pids(cluster.engines[set_id])
        self._source.pids |= launch.launched_pids(cluster)

    def refill(self) -> None:
        """Launch spares until ``want`` are ready or on their way."""
        self._launched = {pid for pid in self._launched if launch.is_alive(pid)}
        self.launch(self.want - len(self._launched) - len(self._ready))

    def warm(self, rank_engines: set[int]) -> None:
        """Ask each newly registered spare to describe itself (it imports torch), and collect answers; never waits."""
        client = self._source.client
        for eid in set(client.ids) - rank_engines - self._retired - set(self._warming) - set(self._ready):
            self._warming[eid] = client[eid].apply_async(runtime.describe_engine, self._controller_host)
        for eid, answer in list(self._warming.items()):
            if answer.done():
                del self._warming[eid]
                if answer.exception() is not None:
                    self._retired.add(eid)
                    continue
                self._ready[eid] = engine_info(eid, answer.result())
                self._launched.discard(self._ready[eid].pid)

    def take(self, n: int, rank_engines: set[int], wait_s: float) -> list[EngineInfo]:
        """Up to ``n`` warmed spares, waiting at most ``wait_s`` for more; launches any still missing."""
        self.warm(rank_engines)
        self._ready = {eid: info for eid, info in self._ready.items()
                       if eid in self._source.client.ids and launch.is_alive(info.pid)}
        self._launched = {pid for pid in self._launched if launch.is_alive(pid)}
        self.launch(n - len(self._ready) - len(self._launched))
        deadline = time.monotonic() + wait_s
        while len(self._ready) < n and time.monotonic() < deadline:
            time.sleep(0.05)
            self.warm(rank_engines)
        return [self._ready.pop(eid) for eid in sorted(self._ready)[:n]]
