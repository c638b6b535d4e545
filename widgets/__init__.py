"""Views only: widgets and matplotlib figures fed by plain records; never imports torch or kernels.

Each view is an anywidget (live, in a notebook) with a matplotlib twin for static output:

- ``ClusterView(ranks)`` / ``plot_cluster(ranks)``: RankStatus dicts, one card per rank;
- ``CollectiveView(records)`` / ``plot_collective(records, op)``: ``run_collectives`` records
  with the ring algorithm replayed on the real inputs;
- ``ShardingView(layout)`` / ``plot_sharding(layout, layer)``: per-rank layout records.
"""
from widgets.cluster_view import ClusterView, plot_cluster
from widgets.collective_view import CollectiveView, plot_collective
from widgets.sharding_view import ShardingView, plot_sharding

__all__ = ["ClusterView", "CollectiveView", "ShardingView", "plot_cluster", "plot_collective", "plot_sharding"]
