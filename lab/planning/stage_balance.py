"""Balancing pipeline stages: how many blocks each stage gets when the first also embeds and the last also
projects onto the vocabulary and takes the loss.

A pipeline runs as fast as its busiest rank (in the steady state every rank handles every micro-batch
once), so equal blocks per stage are not equal work: the last stage's LM head costs 2·h·V FLOPs per token,
V/(12h) blocks of a GPT-shaped model (2.6 blocks for Llama-3-8B, whose 128k vocabulary is why Megatron and
torchtitan let the first and last stages hold fewer layers; GPipe's ``balance=[...]`` gives each stage's
count by hand). ``balance_stages`` proposes ``stage_layers`` for ``lab.Parallel``:

- **costs** in one unit, a block's and what the first and last stage add (``StageCosts``):
  - estimated from the shape (``estimated_costs``): ``by="compute"`` counts forward FLOPs per token as
    Megatron-LM does (Narayanan et al., 2021, §5.1): a block 2·Ψ_block (its active weights) + 4·s·d_attn
    (scores and their use), the head 2·h·V, the embedding lookup none (the backward, 2x the forward, keeps
    the ratios); ``by="memory"`` counts parameters: the embedding table (and positions) on the first stage,
    the head's copy and the final norm on the last;
  - or measured (``measured_costs``): each stage's compute seconds in traced runs (``trace=True``) under
    their splits, fitted as blocks·block + first + last by least squares: a block's cost from the stages
    that hold only blocks, or from how a stage's time moved with its blocks between two splits;
- **the split**: every stage holds at least one block; blocks go one at a time to the pipeline rank whose
  load grows least (the placement's ranks: a V schedule's rank 0 holds both ends), then within the rank to
  its lightest stage. For identical blocks that greedy order minimises the busiest rank's load.

Pure Python; no torch. Run alone (Llama-3-8B on 4 stages)::

    python -m lab.planning.stage_balance
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from kernels.contract.layout_rules import canonical_schedule, default_stages_per_rank, layer_split, stage_ids
from lab.measure.timeline import stage_compute
from lab.planning.plan_models import ModelSpec
from lab.planning.plan_own_models import model_spec

BY = ("compute", "memory")


@dataclass(frozen=True)
class StageCosts:
    """What a block costs, and what the first and the last stage add, in one ``unit``."""

    block: float
    first: float  # the token embedding (and position table)
    last: float  # final norm, LM head and loss
    unit: str  # "FLOPs per token", "parameters" or "seconds per step"
    source: str  # where the figures come from, in words

    def stage_cost(self, blocks: int, stage: int, num_stages: int) -> float:
        """One stage's cost in blocks (block-equivalents): its blocks, plus the ends it holds."""
        ends = (self.first if stage == 0 else 0.0) + (self.last if stage == num_stages - 1 else 0.0)
        return blocks + ends / self.block


@dataclass(frozen=True)
class StageBalance:
    """A proposed ``stage_layers`` beside the equal split, each stage's and rank's cost in block-equivalents."""

    stage_layers: tuple[int, ...]  # the proposal: blocks per stage, in stage order
    even_layers: tuple[int, ...]  # the equal split (layout_rules.layer_split)
    rank_stages: tuple[tuple[int, ...], ...]  # [pp rank] its stages (the schedule's placement)
    costs: StageCosts

    def stage_load(self, split: Sequence[int]) -> tuple[float, ...]:
        """Each stage's cost under ``split``, in blocks."""
        return tuple(self.costs.stage_cost(n, s, len(split)) for s, n in enumerate(split))

    def rank_load(self, split: Sequence[int]) -> tuple[float, ...]:
        """Each pipeline rank's cost under ``split`` (the sum over its stages), in blocks."""
        load = self.stage_load(split)
        return tuple(sum(load[s] for s in stages) for stages in self.rank_stages)

    @property
    def busiest(self) -> float:
        """The busiest rank's load under the proposal: what sets the pipeline's pace."""
        return max(self.rank_load(self.stage_layers))

    @property
    def even_busiest(self) -> float:
        """The busiest rank's load with equal stages."""
        return max(self.rank_load(self.even_layers))

    @property
    def speedup(self) -> float:
        """even_busiest / busiest: how much faster the steady state runs under the proposal (>= 1)."""
        return self.even_busiest / self.busiest

    def describe(self) -> str:
        """One line: the proposal, what the ends cost, and the busiest rank against equal stages."""
        c = self.costs
        ends = f"the embedding costs {c.first / c.block:.2f} blocks, the head and loss {c.last / c.block:.2f}"
        if self.stage_layers == self.even_layers:
            return f"equal stages {list(self.even_layers)} are balanced already ({ends}; {c.source})"
        return (f"stage_layers={list(self.stage_layers)} balances the stages ({ends}; {c.source}): the busiest "
                f"rank does {self.busiest:.2f} block-equivalents against {self.even_busiest:.2f} with equal stages "
                f"{list(self.even_layers)}, {self.speedup:.2f}x")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields, with each rank's load under both splits."""
        return {**dataclasses.asdict(self), "rank_load": list(self.rank_load(self.stage_layers)),
                "even_rank_load": list(self.rank_load(self.even_layers)), "speedup": self.speedup}


def estimated_costs(model: Any, *, by: str = "compute", seq_len: int | None = None) -> StageCosts:
    """A block's and the ends' cost from the model's shape (module docstring); ``model`` as ``lab.plan`` takes it."""
    spec = model_spec(model)
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    if not spec.has_shape or spec.vocab is None or spec.ffn is None:
        raise ValueError(f"{spec.name}: balancing stages needs the model's shape (layers, hidden, ffn, vocab)")
    h, vocab, s = spec.hidden, spec.vocab, seq_len or spec.seq_len
    embed = vocab * h + (spec.seq_len * h if spec.learned_pos else 0)
    norm = (2 if spec.bias else 1) * h
    ends = embed + norm + (0 if spec.tied_embeddings else vocab * h)  # what the shape's count holds beside blocks
    if by == "memory":  # a pipeline's last stage holds the head (a tied one as its own copy) and the final norm
        block = (spec.shape_params - ends) / spec.layers
        return StageCosts(block, float(embed), float(vocab * h + norm), "parameters", "estimated: parameters")
    attention = 4 * s * (spec.heads or 1) * (spec.head_dim or h // (spec.heads or 1))
    block = 2 * (spec.active_params - ends) / spec.layers + attention
    return StageCosts(block, 0.0, 2.0 * h * vocab, "FLOPs per token", "estimated: forward FLOPs")


def measured_costs(runs: Iterable[Any]) -> StageCosts:
    """A block's and the ends' cost in seconds from traced pipeline runs of one model and batch.

    ``runs``: ``lab.RunResult``s of ``trace=True`` runs (or dicts with their ``events`` and ``layout``), under
    one split or several. Each stage's compute (``lab.measure.timeline.stage_compute``) is fitted as
    blocks·block + first + last by least squares: with first/last free per end, the block's cost is the
    pooled slope (within the first stages, within the last stages, and through the origin for stages
    holding blocks only). ValueError when no stage tells it: two stages traced under one split only.
    """
    groups: dict[str, list[tuple[int, float]]] = {"first": [], "last": [], "middle": []}
    for run in runs:
        split, seconds = _split_of(run), stage_compute(_field(run, "events"))
        for stage, blocks in enumerate(split):
            kind = "first" if stage == 0 else "last" if stage == len(split) - 1 else "middle"
            groups[kind].append((blocks, seconds[stage]))
    num, den = 0.0, 0.0
    for kind, points in groups.items():
        if not points:
            continue
        mean_n = 0.0 if kind == "middle" else sum(n for n, _ in points) / len(points)
        mean_t = 0.0 if kind == "middle" else sum(t for _, t in points) / len(points)
        num += sum((n - mean_n) * (t - mean_t) for n, t in points)
        den += sum((n - mean_n) ** 2 for n, _ in points)
    if den == 0 or num <= 0:
        raise ValueError("the traces do not tell a block's cost from the ends': trace a pipeline of 3 or more "
                         "stages, or a second run under another stage_layers")
    block = num / den
    end = {k: sum(t - block * n for n, t in groups[k]) / len(groups[k]) for k in ("first", "last")}
    return StageCosts(block, max(end["first"], 0.0), max(end["last"], 0.0), "seconds per step",
                      f"measured: {sum(map(len, groups.values()))} traced stages")


def balance_stages(model: Any, pp: int, *, stages_per_rank: int | None = None, schedule: str = "1f1b",
                   by: str = "compute", seq_len: int | None = None, measured: Iterable[Any] | None = None,
                   costs: StageCosts | None = None) -> StageBalance:
    """Propose ``stage_layers`` for ``lab.Parallel(pp=pp, schedule=..., stage_layers=...)`` (module docstring).

    ``model``: as ``lab.plan`` takes it (a preset name, ``lab.GPT``, ``lab.Llama``, a Hugging Face config, a
    ``ModelSpec``). Costs: ``costs`` as given, else ``measured_costs(measured)`` when traced runs are given,
    else ``estimated_costs(model, by=by, seq_len=seq_len)``.
    """
    spec = model_spec(model)
    schedule = canonical_schedule(schedule)
    v = stages_per_rank or default_stages_per_rank(schedule)
    placement = tuple(stage_ids(schedule, r, pp, v) for r in range(pp))
    num_stages = pp * v
    if spec.layers is None or spec.layers < num_stages:
        raise ValueError(f"{spec.name}: {num_stages} stages need at least as many blocks, got layers={spec.layers}")
    if costs is None:
        costs = measured_costs(measured) if measured is not None else estimated_costs(spec, by=by, seq_len=seq_len)
    if not costs.block > 0 or min(costs.first, costs.last) < 0:
        raise ValueError(f"a block must cost more than nothing and the ends no less than nothing, got {costs}")
    even = tuple(len(layer_split(spec.layers, num_stages, s)) for s in range(num_stages))
    return StageBalance(_greedy_split(spec.layers, costs, placement, num_stages), even, placement, costs)


def plan_balance(spec: ModelSpec, lay: Any, seq_len: int) -> StageBalance | None:
    """What ``lab.plan`` reports for a pipeline layout (``Layout``): the compute-balanced split of its stages;
    None without a pipeline, or for a model known by its parameter count only."""
    if lay.pp == 1 or not spec.has_shape or spec.vocab is None or spec.ffn is None or spec.layers < lay.num_stages:
        return None
    return balance_stages(spec, lay.pp, stages_per_rank=lay.stages_per_rank, schedule=lay.schedule, seq_len=seq_len)


def plan_balance_notes(balance: StageBalance | None, lay: Any) -> list[str]:
    """A plan's note when its stages are not the balanced ones (``Layout.stage_layers``, or equal stages)."""
    if balance is None or (lay.stage_layers or balance.even_layers) == balance.stage_layers:
        return []
    return [balance.describe() + "; pass it to lab.Parallel(stage_layers=...) (the plan sizes "
            + (f"stage_layers={list(lay.stage_layers)})" if lay.stage_layers else "equal stages)")]


def _greedy_split(layers: int, costs: StageCosts, placement: tuple[tuple[int, ...], ...],
                  num_stages: int) -> tuple[int, ...]:
    """One block to every stage, then each further block to the rank whose load grows least, within it to the
    lightest stage (ties: the lower index, so without ends the split is ``layer_split``'s)."""
    split = [1] * num_stages

    def stage_load(s: int) -> float:
        return costs.stage_cost(split[s], s, num_stages)

    ranks = [(sum(stage_load(s) for s in stages), r) for r, stages in enumerate(placement)]
    heapq.heapify(ranks)
    for _ in range(layers - num_stages):
        load, r = heapq.heappop(ranks)
        stage = min(placement[r], key=lambda s: (stage_load(s), s))
        split[stage] += 1
        heapq.heappush(ranks, (load + 1.0, r))
    return tuple(split)


def _field(run: Any, name: str) -> Any:
    return run[name] if isinstance(run, Mapping) else getattr(run, name)


def _split_of(run: Any) -> list[int]:
    """Blocks per stage of a run, from its ranks' layout records ({"stage_layers": {stage: [blocks]}})."""
    held: dict[int, int] = {}
    for record in _field(run, "layout"):
        held.update({int(s): len(blocks) for s, blocks in record.get("stage_layers", {}).items()})
    if not held:
        raise ValueError("a run without pipeline stages: measured_costs takes traced runs with pp > 1")
    return [held[s] for s in range(len(held))]


if __name__ == "__main__":
    print(balance_stages("llama3-8b", 4).describe())
    print(balance_stages("llama3-8b", 4, by="memory").describe())
