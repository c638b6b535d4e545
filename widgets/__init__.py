"""Views only: widgets and matplotlib figures fed by records; never imports torch, lab or rank code.

The record shapes are ``kernels.contract.records`` (standard library only): each view takes the
records or their ``to_dict()`` dicts, and checks dicts with ``from_dict``, so a record of
another shape fails with the record's name and the key.

Each view is an anywidget (live, in a notebook) with a matplotlib twin for static output; its display bundle
also carries the twin's PNG of its current state (``widgets.static_figure``), what a notebook read without a
kernel shows:

- ``ClusterView(ranks)`` / ``plot_cluster(ranks)``: RankStatus, one card per rank;
- ``CollectiveView(records)`` / ``plot_collective(records, op)``: CollectiveRecord from
  ``run_collectives``, with the ring algorithm replayed on the real inputs;
- ``ShardingView(layout)`` / ``plot_sharding(layout, layer)``: LayoutRecord per rank;
- ``PipelineTimeline(events, bubble, planned)`` / ``plot_timeline(events, bubble)``: TraceEvent
  records, the measured BubbleReport beside the theory, the planned order as an overlay;
- ``MemoryView(records)`` / ``plot_memory(records, moment)``: MemoryRecord, measured beside predicted;
- ``ScheduleGallery(runs)`` / ``plot_gallery(runs)``: several runs' TraceEvents and BubbleReports, one
  panel per schedule on one shared time axis, replayed in lock-step;
- ``PSTimeline(spans)`` / ``plot_ps_timeline(spans)``: PSSpan (``kernels.contract.records``), a parameter
  server's pull/compute/push/apply per rank; ``plot_staleness`` and ``plot_losses`` beside it;
- ``TrainingDashboard(records, world_size=n)`` / ``plot_dashboard(records)``: StepProgress
  (``kernels.contract.records``), live from a run handle or replayed from a saved run;
- ``ExpertRouting(records, step, layer)`` / ``plot_routing(records, step, layer)``: RoutingStep
  (``kernels.contract.expert_context_records``), one MoE layer's all-to-all matrix (rank x expert, grouped by
  ep rank), the load per expert and the check assignments == tokens x top_k; numbers from ``routing_matrix``;
- ``RingTimeline(records, step, layer)`` / ``plot_ring(records, step, layer)``: RingStep (same module), one
  ring-attention call per cp rank: compute on each kv block, the wait after it, the transfer it overlaps;
  numbers from ``ring_lanes``.
"""
from widgets.cluster_view import ClusterView, plot_cluster
from widgets.collective_view import CollectiveView, plot_collective
from widgets.expert_routing import ExpertRouting, plot_routing
from widgets.memory_view import MemoryView, plot_memory
from widgets.pipeline_timeline import PipelineTimeline, plot_timeline
from widgets.ps_timeline import PSTimeline, plot_losses, plot_ps_timeline, plot_staleness
from widgets.ring_timeline import RingTimeline, plot_ring
from widgets.schedule_gallery import ScheduleGallery, plot_gallery
from widgets.sharding_view import ShardingView, plot_sharding
from widgets.training_dashboard import TrainingDashboard, plot_dashboard

__all__ = ["ClusterView", "CollectiveView", "MemoryView", "PipelineTimeline", "ScheduleGallery", "ShardingView",
           "plot_cluster", "plot_collective", "plot_gallery", "plot_memory", "plot_sharding", "plot_timeline",
           "TrainingDashboard", "plot_dashboard", "PSTimeline", "plot_ps_timeline", "plot_staleness", "plot_losses",
           "ExpertRouting", "plot_routing", "RingTimeline", "plot_ring"]
