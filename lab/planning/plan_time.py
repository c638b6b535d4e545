"""How long one iteration of a layout takes, as the planner estimates it: compute, bubble and each link.

    step = compute + bubble + inside nodes + between nodes

- compute: one rank's share of the iteration's FLOPs, F·tokens / gpus, with F of
  ``plan_math.model_flops_per_token`` (Narayanan et al. 2021's count, plus what recomputation runs again),
  at ``gpu_tflops`` × ``mfu``;
- bubble: the compute times the schedule's bubble-to-ideal ratio, (p-1)/(v·m) for 1F1B
  (``kernels.contract.layout_rules.bubble_theory``); a schedule with no closed form (DualPipeV) is charged 1F1B's;
- each link: ``LinkLoad.time_s``, the α–β time of every call the rank makes on it (``plan_latency``).

Nothing overlaps in this sum. On a GPU DDP's buckets and FSDP's prefetches do run beside the compute, so the
estimate is an upper bound; what it ranks is the traffic no overlap can hide once it outlasts the compute. A
layout whose traffic between nodes takes longer than its compute gets the warning [verify-bandwidth]: the
sizing guides' step 4, "check that the bandwidth the chosen degrees need does not exceed the network's"
(the Turing Inc. guide's example: 245 GB per iteration needs 1,960 Gbps against EFA's 3,200).

The defaults are an H100 SXM's dense bf16 peak (NVIDIA's data sheet, as ``lab.measure.throughput``) and an MFU
of 0.5, about what Megatron-LM reached on A100s (Narayanan et al. 2021: 52 % of peak for GPT-3 175B); they go with
the planner's default NVLink and EFA links. Pure Python; no torch.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lab.planning.plan_work import CommEntry
from lab.planning.plan_latency import collective_steps
from lab.planning.plan_math import GB, gbps, model_flops_per_token, required_bandwidth
from lab.planning.plan_mesh import Layout
from lab.planning.plan_models import ModelSpec
from lab.planning.plan_moe import idle_params

DEFAULT_GPU_TFLOPS = 989.0  # H100 SXM, dense bf16
DEFAULT_MFU = 0.5


@dataclass(frozen=True)
class LinkLoad:
    """One link's share of an iteration: bytes one rank sends, time, and bandwidth needed."""

    link: str  # "intra" or "inter"
    bandwidth_gbps: float  # the link's bandwidth in GB/s (1e9 bytes/s) as given to plan()
    wire_bytes: float
    time_s: float  # latency_s + wire_bytes / bandwidth, with no overlap
    needed_gbps: float  # GB/s to move wire_bytes within the target iteration time
    alpha_us: float = 0.0  # the link's latency per ring step as given to plan(), microseconds
    latency_s: float = 0.0  # α × the ring steps of every call on the link (docs/design.md#collective-latency)


def link_loads(comm: tuple[CommEntry, ...], costs: Mapping[str, tuple[float, float]],
               target_iter_s: float) -> tuple[LinkLoad, ...]:
    """Each link's load; ``costs[link]`` is (GB/s, µs per ring step)."""
    out = []
    for name, (bw, alpha_us) in costs.items():
        mine = [e for e in comm if e.link == name]
        wire = sum(e.wire_bytes for e in mine)
        latency = alpha_us * 1e-6 * sum(e.count * collective_steps(e.op, e.group_size) for e in mine)
        out.append(LinkLoad(name, bw, wire, latency + wire / (bw * GB) if bw > 0 else math.inf,
                            required_bandwidth(wire, target_iter_s), alpha_us, latency))
    return tuple(out)


@dataclass(frozen=True)
class StepTime:
    """The estimated seconds of one iteration on one rank, by what they are spent on (module docstring)."""

    compute_s: float  # the rank's FLOPs at gpu_tflops × mfu, recomputation included
    bubble_s: float  # pipeline idle time: compute_s × the bubble-to-ideal ratio
    intra_s: float  # traffic inside a node (LinkLoad.time_s, latency included)
    inter_s: float  # traffic between nodes
    sequences: int  # the global batch: sequences one iteration trains on
    gpu_tflops: float  # the peak it was priced at, TFLOP/s per GPU
    mfu: float  # the share of that peak the compute reaches

    @property
    def total_s(self) -> float:
        """compute + bubble + both links: nothing overlapped."""
        return self.compute_s + self.bubble_s + self.intra_s + self.inter_s

    @property
    def per_sequence_s(self) -> float:
        """Seconds per trained sequence: layouts with different global batches compare on it."""
        return self.total_s / self.sequences

    def to_dict(self) -> dict[str, float]:
        """JSON-able fields, with the total and the time per sequence."""
        return {**self.__dict__, "total_s": self.total_s, "per_sequence_s": self.per_sequence_s}


def step_time(spec: ModelSpec, lay: Layout, links: tuple[LinkLoad, ...], gpus: int, global_batch: int,
              microbatches: int, seq_len: int, bubble_ratio: float | None, *,
              gpu_tflops: float = DEFAULT_GPU_TFLOPS, mfu: float = DEFAULT_MFU) -> StepTime:
    """The estimate of one iteration of ``global_batch`` sequences of ``seq_len`` tokens on ``gpus`` GPUs.

    ``bubble_ratio`` is ``bubble_theory``'s second value (None: no closed form, charged 1F1B's (p-1)/m with
    m = ``microbatches``).
    Raises ValueError for a peak or an MFU that is not positive (an MFU above 1 is refused too).
    """
    if gpu_tflops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"gpu_tflops must be > 0 and mfu in (0, 1], got gpu_tflops={gpu_tflops}, mfu={mfu}")
    active = spec.params - idle_params(spec)  # a token runs top_k of each MoE layer's experts
    flops = model_flops_per_token(active, spec.layers, spec.hidden, seq_len, lay.activation_checkpointing)
    compute = flops * global_batch * seq_len / gpus / (gpu_tflops * 1e12 * mfu)
    if lay.pp == 1:
        bubble_ratio = 0.0
    elif bubble_ratio is None:
        bubble_ratio = (lay.pp - 1) / microbatches
    by_link = {load.link: load.time_s for load in links}
    return StepTime(compute, compute * bubble_ratio, by_link.get("intra", 0.0), by_link.get("inter", 0.0),
                    global_batch, gpu_tflops, mfu)


def bandwidth_warnings(step: StepTime, links: tuple[LinkLoad, ...]) -> list[str]:
    """[verify-bandwidth] when the traffic between nodes outlasts the compute (module docstring)."""
    inter = next((load for load in links if load.link == "inter"), None)
    if inter is None or not inter.wire_bytes or step.inter_s <= step.compute_s:
        return []
    needed = inter.wire_bytes / step.compute_s / GB
    return [f"[verify-bandwidth] {inter.wire_bytes / GB:,.1f} GB per iteration between nodes take "
            f"{step.inter_s:,.2f} s at {inter.bandwidth_gbps:g} GB/s, longer than the {step.compute_s:,.2f} s of "
            f"compute: keeping up needs {needed:,.1f} GB/s ({gbps(needed):,.0f} Gbps) between nodes "
            "(the sizing guides' step 4, verify the bandwidth)"]
