"""Size a training layout analytically, or pick one first: the entry behind ``lab.plan``.

``plan(model="llama3-70b", gpus=32, gpus_per_node=8, gpu_mem_gb=80, parallel=...)``
returns a frozen ``Plan`` (``lab.planning.plan_layout``, where the formulas are applied).
With no ``parallel``, the layout is ``recommend()``'s best. Pure Python; no torch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from lab.planning.plan_latency import DEFAULT_ALPHA_US
from lab.planning.plan_layout import Plan, plan_layout
from lab.planning.plan_models import ModelSpec
from lab.planning.plan_own_models import model_spec
from lab.planning.plan_time import DEFAULT_GPU_TFLOPS, DEFAULT_MFU
from lab.planning.recommend import recommend


def plan(model: str | float | ModelSpec | Mapping[str, Any], gpus: int, gpus_per_node: int = 8,
         gpu_mem_gb: float = 80.0, intra_bw: float = 900.0, inter_bw: float = 400.0,
         parallel: Any = None, global_batch: int | None = None, micro_batch: int | None = None,
         seq_len: int | None = None, dtype: str = "bf16", optimizer: str | float = "adam",
         activation_checkpointing: bool | None = None, schedule: str | None = None,
         microbatches: int | None = None, target_iter_s: float = 1.0,
         activations_gb: float | None = None, intra_alpha_us: float = DEFAULT_ALPHA_US["intra"],
         inter_alpha_us: float = DEFAULT_ALPHA_US["inter"], ep: int | None = None, cp: int | None = None,
         gpu_tflops: float = DEFAULT_GPU_TFLOPS, mfu: float = DEFAULT_MFU) -> Plan:
    """Size one layout analytically.

    ``model``: a preset name, a parameter count, a dict of shape fields, a ``ModelSpec``, a ``lab.GPT``,
    or a config whose fields give the shape: a ``lab.Llama`` or a Hugging Face config
    (``lab.planning.plan_own_models``).

    ``parallel``: a ``lab.run.parallel.Parallel``, any object with its attributes, or a dict
    (dp may be left out of a dict: it is gpus / (tp·pp·cp)); None asks ``recommend()``.
    ``ep``: expert parallelism (each MoE layer's experts split over groups of ep dp ranks; ep divides dp
    and the experts); ``cp``: context parallelism (each sequence split over cp ranks, attention as a ring;
    world = pp·dp·cp·tp). Given here they win over ``parallel``'s; with no ``parallel`` they fix
    ``recommend()``'s search (docs/design.md#experts-and-context-parallelism).
    ``intra_bw``/``inter_bw``: GB/s per GPU inside a node and between nodes (defaults:
    the sizing guides' NVLink 900GB/s and EFA 3,200Gbps = 400GB/s). ``intra_alpha_us``/``inter_alpha_us``:
    each link's latency per ring step, which every call pays 2(n-1) times for an all-reduce
    (``lab.planning.plan_latency``; defaults a public estimate for the same hardware, or the pool's own
    from ``lab.measure.bench.planner_links``). ``schedule`` and
    ``activation_checkpointing`` default to the parallel object's, else "1f1b" and off.
    ``optimizer``: "adam" (K=12, docs/design.md#zero-formulas), "adam_bf16" (K=4, the Turing Inc. guide's convention),
    "sgd", "sgd_momentum", or K itself. ``activations_gb`` replaces the activation
    estimate (the sizing guides' TP example assumes 20GB). ``gpu_tflops`` (one GPU's peak, TFLOP/s; default an
    H100's dense bf16) and ``mfu`` (the share of it the compute reaches) price the compute of ``Plan.step``, the
    estimated iteration beside the links' time (``lab.planning.plan_time``), which ``recommend()`` ranks by.
    Raises ValueError when dp·cp·tp·pp ≠ gpus.
    """
    spec = model_spec(model)
    options = dict(intra_bw=intra_bw, inter_bw=inter_bw, global_batch=global_batch, micro_batch=micro_batch,
                   seq_len=seq_len, dtype=dtype, optimizer=optimizer, microbatches=microbatches,
                   activation_checkpointing=activation_checkpointing, target_iter_s=target_iter_s,
                   activations_gb=activations_gb, intra_alpha_us=intra_alpha_us, inter_alpha_us=inter_alpha_us,
                   gpu_tflops=gpu_tflops, mfu=mfu)
    if parallel is None:
        return _recommended(spec, gpus, gpus_per_node, gpu_mem_gb,
                            {**options, "schedule": schedule or "1f1b", "ep": ep, "cp": cp})
    return plan_layout(spec, gpus, gpus_per_node, gpu_mem_gb, parallel=parallel, schedule=schedule, ep=ep, cp=cp,
                       **options)


def _recommended(spec: ModelSpec, gpus: int, gpus_per_node: int, gpu_mem_gb: float,
                 kwargs: dict[str, Any]) -> Plan:
    best = recommend(spec, gpus, gpus_per_node, gpu_mem_gb, **kwargs).best
    return dataclasses.replace(best.plan, notes=best.plan.notes + (f"layout from recommend(): {best.reason}",))
