"""Lay out a pipeline schedule's compute order in time: the planned timeline, from data dependencies alone.

Each pipeline rank runs its actions (stage, letter, micro-batch) in the given order;
an action starts once its rank is free and its input exists, with zero-latency p2p:

- F (forward) of stage s needs F of stage s-1 (stage 0 needs nothing);
- B (full backward) or I (input-gradient backward, Zero Bubble, Qi et al., 2024) of
  stage s needs the gradient from stage s+1, or, on the last stage, its own forward;
- W (weight-gradient backward) needs this stage's own I.

The order comes from GPipe/1F1B's definitions or from torch's ``pipeline_order``;
the costs are seconds per letter (measured means, or fixed synthetic costs), so the
idle share of the result is the bubble the order implies. Torch-free: used by the
driver (``lab.measure.timeline.simulate``) and by the timeline view's planned overlay.

Try it alone (1F1B on 2 ranks, 4 micro-batches)::

    python -m kernels.contract.schedule_simulation
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

Action = tuple[int, str, int]  # (global stage, "F" | "B" | "I" | "W", micro-batch)


class Placed(NamedTuple):
    """One action laid out in time, in seconds (or whatever unit the costs are in)."""

    rank: int
    stage: int
    letter: str
    microbatch: int
    start: float
    end: float


def ready_time(action: Action, done: Mapping[tuple[int, str, int], float], last_stage: int) -> float | None:
    """When ``action``'s input exists, or None while its producer has not been placed.

    ``done`` maps (stage, "F" or "G", micro-batch) to the end of that stage's forward or
    of its input-gradient backward ("G": B or I).
    """
    stage, letter, mb = action
    if letter == "F":
        return 0.0 if stage == 0 else done.get((stage - 1, "F", mb))
    if letter in ("B", "I"):
        return done.get((stage, "F", mb)) if stage == last_stage else done.get((stage + 1, "G", mb))
    return done.get((stage, "G", mb))


def lay_out(orders: Mapping[int, list[Action]], costs: Mapping[str, float], *,
            force_when_stuck: bool = False, action_costs: Mapping[Action, float] | None = None,
            latency: Mapping[Action, float] | None = None) -> list[Placed]:
    """Start every rank's actions in order, each once its rank is free and its input exists.

    ``costs`` are per letter; ``action_costs`` (per action) override them, as when replaying
    a measured step. ``latency`` adds a delay between an action's input existing and the action
    being able to use it (a measured p2p hop). Returns the actions in the order they were placed.
    Orders that would wait forever raise ValueError naming the stuck actions, unless
    ``force_when_stuck``: then the stuck rank that is free first runs its next action anyway
    (to draw a broken plan).
    """
    action_costs, latency = action_costs or {}, latency or {}
    orders = {r: [tuple(a) for a in acts] for r, acts in orders.items() if acts}
    last_stage = max((a[0] for order in orders.values() for a in order), default=0)
    pos, free = dict.fromkeys(orders, 0), dict.fromkeys(orders, 0.0)
    done: dict[tuple[int, str, int], float] = {}
    out: list[Placed] = []

    def place(r: int, ready: float) -> None:
        action = orders[r][pos[r]]
        stage, letter, mb = action
        start = max(free[r], ready + latency.get(action, 0.0))
        cost = action_costs[action] if action in action_costs else costs[letter]
        free[r] = end = start + cost
        done[(stage, "G" if letter in ("B", "I") else letter, mb)] = end
        out.append(Placed(r, stage, letter, mb, start, end))
        pos[r] += 1

    while any(pos[r] < len(order) for r, order in orders.items()):
        moved = False
        for r, order in orders.items():
            while pos[r] < len(order) and (ready := ready_time(order[pos[r]], done, last_stage)) is not None:
                place(r, ready)
                moved = True
        if moved:
            continue
        stuck = {r: order[pos[r]] for r, order in orders.items() if pos[r] < len(order)}
        if not force_when_stuck:
            raise ValueError(f"orders deadlock; next actions waiting forever: {stuck}")
        place(min(stuck, key=lambda r: free[r]), 0.0)
    return out


if __name__ == "__main__":
    one_f_one_b = {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "F", 2), (0, "B", 1), (0, "F", 3),
                       (0, "B", 2), (0, "B", 3)],
                   1: [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1), (1, "F", 2), (1, "B", 2),
                       (1, "F", 3), (1, "B", 3)]}
    placed = lay_out(one_f_one_b, {"F": 1.0, "B": 2.0})
    span = max(p.end for p in placed)
    for rank in one_f_one_b:
        busy = sum(p.end - p.start for p in placed if p.rank == rank)
        print(f"rank {rank}: idle {1 - busy / span:.3f} of {span:g}")
