"""How ``recommend()`` orders its candidate plans, and the words of its "why" column and warnings.

The order (docs/design.md#sources, the procedure in ``lab.planning.recommend``): the least estimated time
per trained sequence (``Plan.step``, ``lab.planning.plan_time``: compute, bubble, and the traffic on each
link, the one between nodes at the bandwidth given), so that the best layout changes with the network as
the sizing guides' step 4 and Fujii's talk say it does; times within ``TIME_TOLERANCE`` of each other are a
tie, which goes to the most data parallelism, then the fewest pipeline stages (the guides' rule when the
network is no constraint). The reason starts with that estimate and names what each parallel dimension buys:
TP and PP the memory, DP the throughput, EP the experts' memory (1/ep of them per rank) for all-to-alls, CP the
activations of long sequences (1/cp) for ring transfers. Pure Python; no torch.
"""
from __future__ import annotations

import math

from lab.planning.plan_layout import Plan
from lab.planning.plan_math import GB
from lab.planning.plan_mesh import axis_link

# Estimates closer than this are a tie: below the accuracy of an MFU guessed for every layout alike and of
# traffic counted with nothing overlapped. Ties go to the guides' order (most DP, then fewest stages), which
# is how the Turing Inc. guide's TP8×DP4 for a 70B model on 32 GPUs stays the answer on a fast network.
TIME_TOLERANCE = 0.10


def rank_key(p: Plan, least_s: float) -> tuple[int, int, int, float]:
    """Rank by estimated seconds per sequence in bands of ``TIME_TOLERANCE`` above ``least_s`` (the least of the
    candidates'); inside a band, the most DP, then the fewest stages, then the time itself."""
    t = p.step.per_sequence_s
    band = math.floor(math.log(t / least_s) / math.log1p(TIME_TOLERANCE) + 1e-9) if t > least_s else 0
    return (band, -p.layout.dp, p.layout.pp, t)


def reason(p: Plan, max_dp: int, fixed_dp: int | None, least_s: float | None = None) -> str:
    """Why a candidate ranks where it does: its estimated step time (against ``least_s``, the least seconds per
    sequence of the layouts that fit), memory, then each dimension and what it buys, then the traffic between
    nodes."""
    lay, mem = p.layout, p.memory
    against = _against(p.step.per_sequence_s / least_s) if least_s and p.fits else ""
    parts = [step_words(p) + against,
             f"{'fits' if p.fits else 'does NOT fit'}: {mem.total / GB:.1f} of {mem.capacity / GB:.0f} GB"
             + (" with activation checkpointing" if lay.activation_checkpointing else "")]
    parts.append(f"TP{lay.tp} inside a node" if lay.tp > 1 else "no TP")
    most = " (the most data parallelism that fits)" if lay.dp == max_dp and p.fits else ""
    parts.append(f"DP{lay.dp}{most}, ZeRO-{lay.zero}" if not lay.fsdp_strategy
                 else f"DP{lay.dp}{most}, FSDP {lay.fsdp_strategy}")
    parts += _expert_and_context(p)
    if lay.pp > 1:
        ok = ">=" if p.microbatches >= 4 * lay.pp else "<"
        why = ""
        if fixed_dp:
            why = f" = gpus/(TP·DP) with DP fixed at {fixed_dp}"
        elif axis_link(lay, "pp", p.gpus_per_node) == "inter" and axis_link(lay, "dp", p.gpus_per_node) == "intra":
            why = " across nodes, DP inside them"
        elif most:
            why = " to fit memory"
        bubble = f"bubble {p.bubble:.1%}" if p.bubble is not None else f"{lay.schedule} bubble: no closed form"
        parts.append(f"PP{lay.pp}{why}, M={p.microbatches} {ok} 4P, {bubble}")
    else:
        parts.append("no PP needed")
    inter = p.link("inter")
    if inter.wire_bytes:
        axes = "+".join(dict.fromkeys(e.axis for e in p.comm if e.link == "inter" and e.wire_bytes))
        wire = inter.wire_bytes
        amount = f"{wire / GB:.1f} GB" if wire >= GB / 10 else f"{wire / 1e6:.2f} MB"  # the lab's tiny models: MB
        parts.append(f"{amount}/iter between nodes ({axes}: {inter.time_s:.2f} s)")
    return "; ".join(parts)


def _against(ratio: float) -> str:
    if ratio <= 1:
        return " (the least per sequence)"
    if ratio < 1 + TIME_TOLERANCE:
        return (f" ({ratio:.2f}× the least per sequence: a tie within {TIME_TOLERANCE:.0%}, where the most DP, then "
                "the fewest stages, rank first)")
    return f" ({ratio:,.2f}× the least per sequence)"


def step_words(p: Plan) -> str:
    """The estimated step time and what it is spent on, e.g. "est. 2.74 s a step of 16 sequences (171 ms
    each): compute 0.50 s, bubble 0.09 s, inside nodes 0.02 s, between nodes 2.13 s"."""
    t = p.step
    split = [f"compute {t.compute_s:.2f} s"] + ([f"bubble {t.bubble_s:.2f} s"] if t.bubble_s else [])
    split += [f"{name} {s:.2f} s" for name, s in (("inside nodes", t.intra_s), ("between nodes", t.inter_s)) if s]
    return (f"est. {t.total_s:.2f} s a step of {t.sequences} sequences ({t.per_sequence_s * 1e3:,.3g} ms each): "
            + ", ".join(split))


def _expert_and_context(p: Plan) -> list[str]:
    """What EP and CP buy in this plan, and the traffic they cost (and on which link)."""
    lay, out = p.layout, []
    if lay.ep > 1:
        link = next((e.link for e in p.comm if e.axis == "ep"), "intra")
        out.append(f"EP{lay.ep}: 1/{lay.ep} of the experts per GPU, {p.memory.experts / GB:.1f} GB of expert states "
                   f"(all of them: {p.memory.experts * lay.ep / GB:.1f} GB), for "
                   f"{p.comm_bytes(axis='ep', op='all_to_all') / GB:.1f} GB/iter of all-to-all ({link})")
    if lay.cp > 1:
        link = next((e.link for e in p.comm if e.axis == "cp"), "intra")
        out.append(f"CP{lay.cp}: {p.seq_len // lay.cp} of {p.seq_len} tokens per GPU, activations 1/{lay.cp}, for "
                   f"{p.comm_bytes(axis='cp') / GB:.1f} GB/iter of ring sends ({link})")
    return out


def best_warnings(best: Plan, fsdp_strategy: str | None) -> list[str]:
    """What the top layout asks of the lab that ``lab.Parallel`` runs differently or not at all, and its
    [verify-bandwidth] warning: the best layout may still be one whose traffic between nodes outlasts its compute."""
    lay = best.layout
    out = [w for w in best.warnings if w.startswith("[verify-bandwidth]")]
    if lay.pp > 1 and best.microbatches < 4 * lay.pp:
        out.append(f"best layout has M={best.microbatches} < 4P={4 * lay.pp}: "
                   "raise the global batch for a smaller bubble")
    if lay.zero == 1 and lay.ep > 1 and not fsdp_strategy:
        out.append("lab.Parallel refuses ZeRO-1 with ep > 1 (its experts are DTensors, which ZeroRedundancyOptimizer "
                   "cannot take): use zero=2 there (the dense parts then shard gradients too)")
    if (lay.ep > 1 and max(lay.tp, lay.pp, lay.cp) > 1) or (lay.cp > 1 and lay.pp > 1):
        out.append("lab.Parallel builds EP beside data parallelism only (not with TP, PP or CP) and CP without PP: "
                   "the best layout is sized for a framework that combines them (its plan's notes name the rule)")
    return out
