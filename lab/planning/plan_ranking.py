"""How ``recommend()`` orders its candidate plans, and the words of its "why" column and warnings.

The order (docs/design.md#sources, the procedure in ``lab.planning.recommend``): M >= 4P first, then the
most data parallelism, then the fewest pipeline stages, then the least time on the links. The reason
names what each parallel dimension buys: TP and PP the memory, DP the throughput, EP the experts'
memory (1/ep of them per rank) for all-to-alls, CP the activations of long sequences (1/cp) for ring
transfers. Pure Python; no torch.
"""
from __future__ import annotations

from lab.planning.plan_layout import Plan
from lab.planning.plan_math import GB


def rank_key(p: Plan) -> tuple[int, int, int, float]:
    """Rank: M ≥ 4P first, then most DP, then fewest stages (hence the most TP), then the least link time."""
    lay = p.layout
    short = lay.pp > 1 and p.microbatches < 4 * lay.pp
    return (int(short), -lay.dp, lay.pp, sum(load.time_s for load in p.links))


def reason(p: Plan, max_dp: int, fixed_dp: int | None) -> str:
    """Why a candidate ranks where it does: memory, then each dimension and what it buys, then the traffic
    between nodes."""
    lay, mem = p.layout, p.memory
    parts = [f"{'fits' if p.fits else 'does NOT fit'}: {mem.total / GB:.1f} of {mem.capacity / GB:.0f} GB"
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
        elif most:
            why = " to fit memory"
        bubble = f"bubble {p.bubble:.1%}" if p.bubble is not None else f"{lay.schedule} bubble: no closed form"
        parts.append(f"PP{lay.pp}{why}, M={p.microbatches} {ok} 4P, {bubble}")
    else:
        parts.append("no PP needed")
    inter = p.link("inter")
    if inter.wire_bytes:
        parts.append(f"{inter.wire_bytes / GB:.1f} GB/iter between nodes ({inter.time_s:.2f} s)")
    return "; ".join(parts)


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
    """What the top layout asks of the lab that ``lab.Parallel`` runs differently or not at all."""
    lay, out = best.layout, []
    if lay.pp > 1 and best.microbatches < 4 * lay.pp:
        out.append(f"best layout has M={best.microbatches} < 4P={4 * lay.pp}: "
                   "raise the global batch for a smaller bubble")
    if lay.zero == 1 and lay.tp > 1 and not fsdp_strategy:
        out.append("ZeRO-1 with TP is Megatron's distributed optimizer; lab.Parallel runs "
                   "ZeRO-1 with ZeroRedundancyOptimizer, which refuses tp > 1: use zero=2 "
                   "there (it needs no more memory)")
    if lay.zero == 1 and lay.ep > 1 and not fsdp_strategy:
        out.append("lab.Parallel refuses ZeRO-1 with ep > 1 (its experts are DTensors, which ZeroRedundancyOptimizer "
                   "cannot take): use zero=2 there (the dense parts then shard gradients too)")
    if (lay.ep > 1 and max(lay.tp, lay.pp, lay.cp) > 1) or (lay.cp > 1 and lay.pp > 1):
        out.append("lab.Parallel builds EP beside data parallelism only (not with TP, PP or CP) and CP without PP: "
                   "the best layout is sized for a framework that combines them (its plan's notes name the rule)")
    return out
