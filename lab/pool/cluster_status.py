"""What each rank of a pool is doing, for the views: ``cluster.status()``, the live ``cluster.view()``, its repr.

``StatusBoard`` is the part of ``lab.pool.cluster.Cluster`` that keeps each rank's state
(idle, busy in a named call, failed, dead), its resident memory and when it was last
heard from, and passes every change to the views that follow the pool.

It works on the Cluster's ``_rank_map``, ``_states``, ``_watchers``, ``_heard``, ``_threads``,
``_local_pids`` and ``_stopped``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kernels.contract.pool_records import RankStatus
from lab.pool import cluster_render, launch

if TYPE_CHECKING:
    from widgets import ClusterView


class StatusBoard:
    """Each rank's state for the views (mixed into ``lab.pool.cluster.Cluster``)."""

    def heard_from(self, when: dict[int, float]) -> None:
        """Note when each rank was last heard from (rank -> wall clock), for ``status()`` and ``view()``."""
        self._heard.update(when)

    def status(self) -> list[RankStatus]:
        """One row per rank: where it runs, what state it is in, and its resident memory."""
        now = time.time()
        return [RankStatus(r.rank, r.host, r.pid, r.device, r.backend, self._threads,
                           *self._states.get(r.rank, ("idle", "")), rss_bytes=self._rss(r.pid),
                           last_heard_s=now - self._heard[r.rank] if r.rank in self._heard else None)
                for r in self._rank_map.ranks]

    def view(self) -> "ClusterView":
        """A live ClusterView of the ranks: it follows every call (busy, failed, dead, memory)."""
        from widgets import ClusterView

        view = ClusterView(self.status())
        self._watchers.append(view.update)
        return view

    def _rss(self, pid: int) -> int | None:
        return launch.resident_bytes(pid) if pid in self._local_pids else None

    def _notify(self) -> None:
        if self._watchers:
            rows = self.status()
            for update in self._watchers:
                update(rows)

    def __repr__(self) -> str:
        return "<Cluster: stopped>" if self._stopped else cluster_render.text(self)

    def _repr_html_(self) -> str:
        return "<p>Cluster: stopped</p>" if self._stopped else cluster_render.html(self)
