"""Expert parallelism (``lab.Parallel(ep=...)``, ``kernels.parallel.expert_parallel``) trains like one process.

Each parity case runs ``kernels.train.entry.train_rank`` on the 4-rank gloo pool for 3 AdamW steps and holds
the losses, gradient norms and final gathered parameters to the layout matrix's fp32 bounds
(``tests.test_layout_parity``: rtol 1e-4, atol 1e-5). EP splits each MoE layer's experts over groups of ep
data-parallel ranks; tokens travel to their experts by all-to-all and back, and the experts' gradients meet
over the replicas as SUM / dp: the parity is the numerical check of that reasoning.

The routing records (``RunResult.routing()``, ``RoutingStep``) must say the same as the reference's: the
ranks' assignments per expert, summed over ranks, equal the one process's in every step and layer. With
``measure=True`` the comm table shows the all-to-alls, whose bytes are counted by hand below. A checkpoint
saved under EP 4 resumes under EP 2 × DP 2 and under ep = 1 (every rank holds every expert).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import lab
from kernels.contract.config_rules import ConfigError
from kernels.model.family import build_model, model_fields
from kernels.parallel.warm_meshes import unkept_group_count
from kernels.train.entry import train_rank
from tests.config_draws import RecordingPool
from tests.layout_runs import Runs, assert_trains_like_one_process, layout_runs, reference_of, tier

TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 32, "vocab": 64, "seq_len": 16, "experts": 4, "top_k": 2}
LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 32, "vocab": 64, "seq_len": 16, "experts": 4,
         "top_k": 2}
BASE = {"model": TINY, "global_batch": 8, "steps": 3, "lr": 1e-2, "seed": 0}

LAYOUTS = {  # id -> the run's layout fields (ranks beyond world_size sit the run out)
    "ep2": {"dp": 2, "ep": 2, "world_size": 2},
    "ep4": {"dp": 4, "ep": 4},
    "ep2-dp2": {"dp": 4, "ep": 2},
    "ep2-dp2-zero3": {"dp": 4, "ep": 2, "zero": 3},
    "ep2-capacity": {"dp": 2, "ep": 2, "world_size": 2, "model": {**TINY, "capacity_factor": 1.0}},
    # Activation checkpointing runs the dispatch's all-to-alls again in backward; micro-batches add up routing.
    "ep2-dp2-ac-microbatches": {"dp": 4, "ep": 2, "activation_checkpointing": True, "microbatches": 2},
    "llama-ep2": {"dp": 2, "ep": 2, "world_size": 2, "model": model_fields(lab.Llama(**LLAMA))},
}
FAST = {"ep2-dp2"}  # the others, and a world of 2 beside the pool, are the slow tier's

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def trained(cluster) -> Runs:
    return layout_runs(cluster, lambda layout: {**BASE, **LAYOUTS[layout]})


@pytest.mark.parametrize("layout", [tier(k, FAST) for k in LAYOUTS])
def test_expert_parallelism_trains_like_one_process(trained, layout):
    cfg, results = trained(layout)
    assert_trains_like_one_process(cfg, results)
    ep, experts = cfg["ep"], cfg["model"]["experts"]
    for res in results:
        held = {name: info["local_shape"] for name, info in res["layout"]["params"].items() if ".experts." in name}
        assert held and all(shape[0] == experts // ep for shape in held.values()), held  # E/ep whole experts


@pytest.mark.parametrize("layout", [tier(k, FAST) for k in LAYOUTS])
def test_the_ranks_route_every_token_as_one_process_does(trained, layout):
    """Per step and MoE layer: the ranks' assignments summed over ranks equal the reference's, and every token
    is routed once per micro-batch forward (an activation-checkpoint recompute is not counted again)."""
    cfg, results = trained(layout)
    ref = reference_of(cfg)
    rows = [row for res in results for row in res["routing_steps"]]
    mine: dict[tuple[int, str], list[int]] = {}
    for row in rows:  # per expert: assignments, then the kept ones, summed over ranks
        summed = mine.setdefault((row["step"], row["layer"]), [0] * 2 * len(row["assigned"]))
        mine[row["step"], row["layer"]] = [a + b for a, b in zip(summed, row["assigned"] + row["kept"])]
    theirs = {(row["step"], row["layer"]): row["assigned"] + row["kept"] for row in ref["routing"]}
    model = cfg["model"]
    assert set(theirs) == {(s, f"blocks.{i}.mlp") for s in range(cfg["steps"]) for i in range(model["layers"])}
    assert mine == theirs
    dropped = sum(sum(row["assigned"]) - sum(row["kept"]) for row in rows)
    assert (dropped > 0) == (model.get("capacity_factor") is not None)  # capacity 1.0 drops some here
    tokens = cfg["global_batch"] * model["seq_len"]
    for step in range(cfg["steps"]):
        step_rows = [row for row in rows if row["step"] == step and row["layer"] == "blocks.0.mlp"]
        assert sum(row["tokens"] for row in step_rows) == tokens
        assert sum(map(sum, (row["assigned"] for row in step_rows))) == tokens * model["top_k"]
    assert {(row["rank"], row["ep_rank"], row["ep"]) for row in rows} == \
        {(rank, rank % cfg["ep"], cfg["ep"]) for rank in range(len(results))}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"pp": 2, "dp": 2, "schedule": "1f1b", "microbatches": 2}, {"tp": 2, "dp": 2}],
                         ids=["pp2-dp2", "tp2-dp2"])
def test_layouts_without_ep_record_the_same_routing(cluster, layout):
    """Pipeline stages record their own layers (their shape inference left out); tp ranks of one replica route
    the same tokens, so one tp rank per replica is summed."""
    cfg = {**BASE, **layout}
    results = cluster.run(train_rank, cfg)
    mine: dict[tuple[int, str], list[int]] = {}
    for res in results:
        if res["layout"]["coords"]["tp"]:
            continue
        for row in res["routing_steps"]:
            summed = mine.setdefault((row["step"], row["layer"]), [0] * len(row["assigned"]))
            mine[row["step"], row["layer"]] = [a + b for a, b in zip(summed, row["assigned"])]
    assert mine == {(row["step"], row["layer"]): list(row["assigned"]) for row in reference_of(cfg)["routing"]}


def test_the_result_and_the_reference_show_the_routing_and_the_measured_all_to_alls(cluster):
    """EP 2 x DP 2, measure=True: per rank and MoE layer, five all_to_alls over the ep group: the (E,) counts
    (int64), then dispatch and combine in forward and again in backward. Dispatch sends the rank's kept
    assignments (n rows of d_model fp32) and its backward brings n rows back; combine sends what the rank's
    experts received (r rows) both ways. Dropless, n = tokens x top_k on every rank and the r of an ep group
    add up to its n, so the group's bytes are 4 x tokens x top_k x d_model x 4 per layer and rank."""
    model = lab.GPT(**TINY)
    exp = lab.Experiment(cluster, model, lab.Parallel(dp=4, ep=2), steps=2, measure=True)
    result = exp.run(progress=False)
    reference = exp.reference()
    last = [r for r in result.routing() if r.step == 1]
    assert sorted({r.layer for r in reference.routing()}) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert lab.RunResult.from_json(result.to_json()).routing() == result.routing()

    d_model, experts, layers, ep = TINY["d_model"], TINY["experts"], TINY["layers"], 2
    tokens_x_k = (8 // 4) * TINY["seq_len"] * TINY["top_k"]  # per rank: its 2 sequences
    local = experts // ep
    a2a = {row["rank"]: row for row in result.comm() if row["op"] == "all_to_all"}
    assert sorted(a2a) == [0, 1, 2, 3] and {row["group_size"] for row in a2a.values()} == {ep}
    for rank, row in a2a.items():
        received = sum(sum(r.kept[(rank % ep) * local:(rank % ep + 1) * local]) for r in last
                       if r.rank // ep == rank // ep)  # what its ep group sent to its experts, every layer
        by_hand = layers * (experts * 8 + 2 * tokens_x_k * d_model * 4) + 2 * received * d_model * 4
        assert (row["count"], row["payload_bytes"]) == (5 * layers, by_hand), rank
    assert sum(row["payload_bytes"] for row in a2a.values()) == \
        4 * layers * (4 * tokens_x_k * d_model * 4 + experts * 8)
    print({rank: row["payload_bytes"] for rank, row in a2a.items()})

    # Parameters at rest: the dense parts whole (DDP), each MoE's experts 1/ep per rank.
    counts = {name: p.numel() for name, p in build_model(model).named_parameters()}
    expert_params = sum(n for name, n in counts.items() if ".experts." in name)
    held = {m["rank"]: m["measured"] for m in result.memory_records
            if m["moment"] == "at_rest" and m["category"] == "params"}
    assert held == {rank: 4 * (sum(counts.values()) - expert_params + expert_params // ep) for rank in range(4)}
    parts = [m for m in result.memory_records if m["category"].startswith("activations.")]
    assert parts and all(m["predicted"] is None and "measured only" in m["predicted_source"] for m in parts)


def test_the_reference_of_a_dense_model_records_no_routing(cluster):
    result = lab.Experiment(cluster, lab.GPT(**{**TINY, "experts": 0}), lab.Parallel(dp=4), steps=1)
    with pytest.raises(lab.NotRecordedError, match="experts=E"):
        result.reference().routing()


# --- a rank whose experts receive no token --------------------------------------------------------------------
def _experts_no_token_reaches() -> dict:
    """On every rank of the pool: a MoE whose router sends every token to expert 0 (top_k 1), its 4 experts one
    per rank. Returns this rank's local expert gradient and the gathered one beside the one-process gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from kernels.model.moe import MoE
    from kernels.parallel.expert_parallel import ExpertGradSync, apply_ep
    from kernels.parallel.mesh import destroy_mesh_groups

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", torch.arange(world).view(1, world), mesh_dim_names=("ep_replicate", "ep"))
    try:
        whole, sharded = MoE(8, 16, world, top_k=1), MoE(8, 16, world, top_k=1)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in whole.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            whole.router.weight.zero_()
            whole.router.weight[0] = 1.0  # positive inputs: expert 0 scores highest for every token
        sharded.load_state_dict(whole.state_dict())
        experts = apply_ep(sharded, mesh)
        x = torch.rand(2 * world, 4, 8, generator=g)
        whole(x).pow(2).mean().backward()
        sharded(x.chunk(world)[rank]).pow(2).mean().backward()
        ExpertGradSync(experts, mesh, world)()
        grad = sharded.experts.w_in.grad
        return {"local": None if grad is None else grad.to_local().abs().max().item(),
                "error": (grad.full_tensor() - whole.experts.w_in.grad).abs().max().item(),
                "reached": sharded.routing_stats()["kept_per_expert"]}
    finally:
        destroy_mesh_groups(mesh)


def test_experts_no_token_reaches_get_a_zero_gradient_not_none(cluster):
    out = cluster.run(_experts_no_token_reaches)
    assert all(o["reached"] == [8, 0, 0, 0] for o in out)  # each rank's 2 sequences of 4 tokens, all to expert 0
    assert out[0]["local"] > 0 and [o["local"] for o in out[1:]] == [0.0, 0.0, 0.0]
    assert max(o["error"] for o in out) < 1e-6
    assert cluster.run(unkept_group_count) == [1] * cluster.world_size


# --- checkpoints ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_saved_under_ep4_resumes_under_ep2_dp2_and_without_ep(cluster, tmp_path):
    def experiment(layout: dict, **options) -> lab.Experiment:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", lab.LayoutWarning)
            return lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(**layout), steps=4, **options)

    whole = experiment({"dp": 4, "ep": 4}, checkpoint_dir=str(tmp_path), checkpoint_every=2).run(progress=False)
    saved = {c.step: c for c in lab.checkpoints(str(tmp_path))}[2]
    for layout in ({"dp": 4, "ep": 2}, {"dp": 4}):
        resumed = experiment(layout, resume_from=saved).run(progress=False)
        assert resumed.steps_ran == [3, 4]
        assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-4), layout
        assert {r.step for r in resumed.routing()} == {2, 3}  # the training's steps, counted from 0
    assert whole.losses == pytest.approx(experiment({"dp": 4, "ep": 4}).reference().losses, rel=1e-4)


@pytest.mark.slow
def test_a_held_training_records_each_calls_routing_and_relayouts_to_another_ep(cluster):
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4, ep=4), steps=3).run(progress=False)
    with lab.Training(cluster, model, lab.Parallel(dp=4, ep=4)) as training:
        first = training.step(2)
        training.relayout(lab.Parallel(dp=4, ep=2))
        last = training.step(1)
    assert first.losses + last.losses == pytest.approx(whole.losses, rel=1e-4)
    assert {r.step for r in first.routing()} == {0, 1} and {r.step for r in last.routing()} == {2}
    assert {r.ep for r in last.routing()} == {2}


# --- refused before launch, each by its rule ----------------------------------------------------------------------
def _refused(make) -> tuple[str, ...]:
    """The rules ``make(pool)`` breaks; lab.GPT refuses its own fields as it is made, lab.Experiment the rest."""
    pool = RecordingPool()
    with warnings.catch_warnings(), pytest.raises(ConfigError) as err:
        warnings.simplefilter("ignore", lab.LayoutWarning)
        make(pool)
    assert pool.calls == [], "a refused config reached the ranks"
    return err.value.rules


@pytest.mark.parametrize("model, parallel, rule", [
    ({**TINY, "experts": 6}, {"dp": 4, "ep": 4}, "ep-experts"),
    ({**TINY, "experts": 0}, {"dp": 2, "ep": 2}, "ep-experts"),
    ({**TINY, "experts": 2, "top_k": 3}, {"dp": 2, "ep": 2}, "moe-top-k"),
    ({**TINY, "experts": 6}, {"dp": 4, "ep": 3}, "ep-dp"),
    (TINY, {"dp": 8, "ep": 2}, "world-size"),
    (TINY, {"dp": 2, "tp": 2, "ep": 2}, "ep-combination"),
    (TINY, {"dp": 4, "ep": 2, "zero": 1}, "ep-sharding"),
], ids=["experts-not-divisible", "no-experts", "top-k-over-experts", "ep-not-dividing-dp", "more-ranks-than-the-world",
        "with-tp", "with-zero1"])
def test_layouts_expert_parallelism_cannot_run_are_refused_by_name(model, parallel, rule):
    rules = _refused(lambda pool: lab.Experiment(pool, lab.GPT(**model), lab.Parallel(**parallel)))
    assert rule in rules, rules


def test_the_ranks_check_the_expert_split_too():
    """A config that skipped lab.Parallel still meets [ep-experts] where the rank builds the layout."""
    from kernels.model.moe import MoE
    from kernels.parallel.expert_parallel import apply_ep

    class EpOfTwo:  # what apply_ep asks of the mesh before it touches a process group
        def size(self, axis: int) -> int:
            return 2

    with pytest.raises(ConfigError, match=r"\[ep-experts\] experts=3 must be divisible by ep=2"):
        apply_ep(torch.nn.Sequential(MoE(8, 16, 3)), EpOfTwo())
