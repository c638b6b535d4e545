"""Views only: widgets and matplotlib figures fed by plain records; never imports torch or kernels.

Each view is an anywidget (live, in a notebook) with a matplotlib twin for static output:

- ``ClusterView(ranks)`` / ``plot_cluster(ranks)``: RankStatus dicts, one card per rank;
- ``CollectiveView(records)`` / ``plot_collective(records, op)``: ``run_collectives`` records
  with the ring algorithm replayed on the real inputs;
- ``ShardingView(layout)`` / ``plot_sharding(layout, layer)``: per-rank layout records;
- ``PipelineTimeline(events, bubble, planned)`` / ``plot_timeline(events, bubble)``: TraceEvent
  dicts, the measured bubble beside the theory, the planned order as an overlay;
- ``MemoryView(records)`` / ``plot_memory(records, moment)``: MemoryRecord dicts, measured beside predicted.
"""
from widgets.cluster_view import ClusterView, plot_cluster
from widgets.collective_view import CollectiveView, plot_collective
from widgets.memory_view import MemoryView, plot_memory
from widgets.pipeline_timeline import PipelineTimeline, plot_timeline
from widgets.sharding_view import ShardingView, plot_sharding

__all__ = ["ClusterView", "CollectiveView", "MemoryView", "PipelineTimeline", "ShardingView", "plot_cluster",
           "plot_collective", "plot_memory", "plot_sharding", "plot_timeline"]
