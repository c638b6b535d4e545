"""The planner reads the network: each layout's estimated step time (compute, bubble, each link) ranks it.

The seed scenarios: Hugging Face's multi-GPU guide ("Scalability Strategy": one node -> DDP; fast links between
nodes -> ZeRO, or PP+TP+DP; slow links and too little memory -> DP+PP+TP+ZeRO-1), the Turing Inc. guide (its
table's 7B-13B -> DP, 70B on 32 GPUs -> TP8×DP4, and step 4, "verify the bandwidth"), and Fujii's talk (the best
configuration changes with the network between nodes). Pure Python: no pool.
"""
from __future__ import annotations

import json

import pytest

from lab.measure.host_traffic import hsdp_neighbour, planned_inter
from lab.planning.plan_math import GB, model_flops_per_token
from lab.planning.plan_mesh import axis_link
from lab.planning.plan_ranking import TIME_TOLERANCE, rank_key
from lab.planning.plan_time import DEFAULT_GPU_TFLOPS, DEFAULT_MFU
from lab.planning.planner import plan
from lab.planning.recommend import recommend

EFA, SLOW = 400.0, 1.0  # GB/s per GPU between nodes: EFA's 3,200 Gbps, and a 1 GB/s link


def _sizes(c) -> tuple[int, int, int]:
    return c.layout.tp, c.layout.pp, c.layout.dp


def test_a_slow_link_moves_llama3_8b_off_dp32_to_a_pipeline_across_nodes():
    fast, slow = recommend("llama3-8b", 32, inter_bw=EFA), recommend("llama3-8b", 32, inter_bw=SLOW)
    assert _sizes(fast.best) == (1, 1, 32)
    assert _sizes(slow.best) != (1, 1, 32) and slow.best.layout.pp > 1
    best, dp32 = slow.best.plan, plan("llama3-8b", 32, parallel={"dp": 32, "zero": 1}, inter_bw=SLOW)
    # DP stays inside each node and only the pipeline's activations cross: under a tenth of DP32's bytes.
    assert axis_link(best.layout, "dp", 8) == "intra" and {e.axis for e in best.comm if e.link == "inter"} == {"pp"}
    assert best.link("inter").wire_bytes < dp32.link("inter").wire_bytes / 10
    assert best.step.per_sequence_s < dp32.step.per_sequence_s
    assert "between nodes (pp:" in slow.best.reason and "across nodes, DP inside them" in slow.best.reason


def test_fast_link_keeps_the_guides_answers():
    # Turing Inc.'s table: 7B-13B -> TP 1, PP 1, DP; its 2D example: 70B on 32 GPUs -> TP8 inside a node, DP4.
    assert _sizes(recommend("llama3-8b", 32, inter_bw=EFA).best) == (1, 1, 32)
    seventy = recommend("llama3-70b", 32, inter_bw=EFA)
    assert _sizes(seventy.best) == (8, 1, 4)
    assert not any(w.startswith("[verify-bandwidth]") for w in seventy.warnings)


def test_slow_link_and_too_little_memory_give_dp_pp_tp_zero1():
    # Hugging Face: "slow inter-node connectivity and still low on GPU memory: DP+PP+TP+ZeRO-1".
    best = recommend("llama3-70b", 32, inter_bw=SLOW).best
    tp, pp, dp = _sizes(best)
    assert tp > 1 and pp > 1 and dp > 1 and best.parallel["zero"] == 1
    assert axis_link(best.layout, "pp", 8) == "inter" and axis_link(best.layout, "dp", 8) == "intra"


def test_one_node_is_plain_data_parallel_whatever_the_link_between_nodes():
    # Hugging Face: a single node whose GPUs each hold the model -> DDP (ZeRO-1 shards only the optimizer).
    ranks = {bw: [c.layout.describe() for c in recommend("llama3-8b", 8, inter_bw=bw)] for bw in (EFA, SLOW)}
    assert ranks[EFA] == ranks[SLOW] and ranks[EFA][0] == "DP8 ZeRO-1"


def test_traffic_between_nodes_longer_than_compute_is_named_verify_bandwidth():
    # The Turing Inc. guide's step 4 example: 70B under FSDP on 8 GPUs moves 245 GB per iteration (forward
    # all-gather and backward reduce-scatter, 122.5 GB each); a GPU per node puts all of it between nodes.
    fsdp = {"dp": 8, "fsdp_strategy": "grad_op"}
    efa = plan("llama3-70b", 8, gpus_per_node=1, parallel=fsdp, inter_bw=EFA)
    slow = plan("llama3-70b", 8, gpus_per_node=1, parallel=fsdp, inter_bw=25.0)  # 200 Gbps
    assert efa.link("inter").wire_bytes / GB == pytest.approx(245.0)
    assert not any("[verify-bandwidth]" in w for w in efa.warnings)
    warning = next(w for w in slow.warnings if w.startswith("[verify-bandwidth]"))
    assert "245.0 GB per iteration between nodes" in warning and "step 4" in warning
    assert slow.step.inter_s > slow.step.compute_s > efa.step.inter_s
    assert any(w.startswith("[verify-bandwidth]") for w in recommend("llama3-8b", 32, inter_bw=0.1).warnings)


def test_step_time_is_compute_bubble_and_each_links_time():
    p = plan("llama3-8b", 32, parallel={"dp": 8, "pp": 4, "zero": 1}, microbatches=16, inter_bw=SLOW)
    tokens = p.global_batch * p.seq_len
    flops = model_flops_per_token(8e9, 32, 4096, 8192) * tokens / 32
    assert p.step.compute_s == pytest.approx(flops / (DEFAULT_GPU_TFLOPS * 1e12 * DEFAULT_MFU))
    assert p.step.bubble_s == pytest.approx(p.step.compute_s * 3 / 16)  # 1F1B: (p-1)/m of the ideal time
    assert (p.step.intra_s, p.step.inter_s) == (p.link("intra").time_s, p.link("inter").time_s)
    assert p.step.total_s == pytest.approx(sum([p.step.compute_s, p.step.bubble_s, p.step.intra_s, p.step.inter_s]))
    assert json.loads(json.dumps(p.to_dict()))["step"]["total_s"] == pytest.approx(p.step.total_s)
    assert "estimated step" in str(p)
    # 6·N + 12·l·s·h per token (Narayanan et al. 2021); full recomputation adds a forward, 2·N + 4·l·s·h.
    assert model_flops_per_token(1.0, 2, 3, 5) == 6 + 12 * 2 * 5 * 3
    assert model_flops_per_token(1.0, 2, 3, 5, recompute=True) == 8 + 16 * 2 * 5 * 3
    slower = plan("llama3-8b", 32, parallel={"dp": 32}, gpu_tflops=DEFAULT_GPU_TFLOPS / 2)
    assert slower.step.compute_s == pytest.approx(2 * plan("llama3-8b", 32, parallel={"dp": 32}).step.compute_s)
    with pytest.raises(ValueError, match="mfu"):
        plan("llama3-8b", 32, parallel={"dp": 32}, mfu=1.5)


def test_recommend_ranks_one_batch_by_time_per_sequence_with_ties_to_the_most_dp():
    rec = recommend("llama3-8b", 32, inter_bw=SLOW, top_k=20)
    assert {c.plan.global_batch for c in rec} == {4 * 32}  # every candidate trains the same batch
    least = min(c.plan.step.per_sequence_s for c in rec)
    keys = [rank_key(c.plan, least) for c in rec]
    assert keys == sorted(keys)
    times = [c.plan.step.per_sequence_s for c in rec]
    for i, earlier in enumerate(times):  # a later candidate is never faster by more than the tie band
        assert all(later * (1 + TIME_TOLERANCE) > earlier for later in times[i + 1:])
    assert all(c.reason.startswith("est. ") for c in rec)
    assert "(the least per sequence)" in rec.best.reason or "a tie within" in rec.best.reason


def test_hsdp_rings_run_inside_the_shard_group_and_across_the_replicas():
    dims = {"dp": 4, "tp": 1, "pp": 1, "dp_replicate": 2}  # shards {0, 1}, {2, 3}; replicas {0, 2}, {1, 3}
    assert [hsdp_neighbour(dims, "all_gather", r) for r in range(4)] == [1, 0, 3, 2]
    assert [hsdp_neighbour(dims, "reduce_scatter", r) for r in range(4)] == [1, 0, 3, 2]
    assert [hsdp_neighbour(dims, "all_reduce", r) for r in range(4)] == [2, 3, 0, 1]
    replicate_only = {**dims, "dp_replicate": 4}  # shards of one rank: the all-reduce is one dp ring
    assert [hsdp_neighbour(replicate_only, "all_reduce", r) for r in range(4)] == [1, 2, 3, 0]


def test_with_context_parallelism_the_data_rings_and_the_cp_ring_name_the_ranks_of_the_run():
    """TP2×CP2 on 4 ranks: the record's dp is the data axis (dp · cp = 2); the tp pairs are {0, 1} and {2, 3}, the
    cp ring and the data ring {0, 2} and {1, 3}, as the ranks measured them."""
    dims = {"dp": 2, "tp": 2, "pp": 1, "dp_replicate": 2, "ep": 1, "cp": 2}
    assert [hsdp_neighbour(dims, "all_reduce", r) for r in range(4)] == [2, 3, 0, 1]
    ring_send = {"source": "dist", "op": "send", "group_size": 2}
    for hosts, crosses in ((["a", "a", "b", "b"], True), (["a", "b", "a", "b"], False)):
        for rank in range(4):
            record = {"rank": rank, "dims": dims}
            assert planned_inter(ring_send, record, 1000.0, {}, hosts) == (1000.0 if crosses else 0.0)
