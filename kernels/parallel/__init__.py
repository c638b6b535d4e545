"""One file per parallelism, each with its ``apply_<x>(model, mesh, **opts)``, and ``parallelize``.

- ``mesh``: ``ParallelDims`` and the (pp, dp, tp) DeviceMesh (plus HSDP's 2D dp mesh);
- ``tensor_parallel``: Megatron TP and sequence parallelism (``apply_tp``);
- ``activation_checkpoint``: per-block recomputation (``apply_ac``);
- ``fsdp``: ZeRO-2/3 and HSDP with FSDP2 (``apply_fsdp``);
- ``ddp``: torch DDP (``apply_ddp``); ``zero1``: ZeroRedundancyOptimizer (``build_zero1_optimizer``);
  ``zero1_slices``: ZeRO-1 with TP or PP, a 1/dp slice of every local shard (``Zero1SliceOptimizer``);
- ``expert_parallel``: each MoE layer's experts split over ep data-parallel ranks, tokens sent by
  all-to-all (``apply_ep``, ``ExpertGradSync``);
- ``pipeline``: stages and torch's pipeline schedules (``build_pipeline``); ``stage_shapes``: what a stage of
  the lab's GPT or Llama takes and gives, so torch need not infer it;
- ``strategy``: the frozen ``Strategy`` a run config resolves to;
- ``parallelize``: applies them in torchtitan's order, TP -> AC -> compile -> FSDP or DDP;
- ``meta_shape_propagation``: DTensor's output shapes of a new mesh's ops worked out on meta tensors;
- ``shared_concatenated_meshes``: one (dp, tp) mesh for all of FSDP2's parameters over TP, not one each;
- ``warm_meshes``: the meshes of recent layouts kept with their groups; ``shared_mesh_groups``: kept meshes with
  an axis in common share its group, so an evicted mesh cannot take a held layout's groups with it.

The teaching twin ``kernels.train.data_parallel_naive`` stays outside, a hand-written DDP for the notebooks.
"""
