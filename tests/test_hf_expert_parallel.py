"""Expert parallelism on Hugging Face mixtures of experts built from configs (``kernels.parallel.hf_expert_parallel``).

A tiny Mixtral and a tiny Qwen3-MoE (4 experts, top-2) train under ``lab.Parallel(ep=...)`` on the 4-rank gloo
pool for 3 AdamW steps: their config's ``base_model_ep_plan`` names the experts modules, whose packed tensors
each rank keeps E/ep of, and whose forward becomes the lab's all-to-all around transformers' own expert math.
Losses, gradient norms and gathered parameters hold to the layout matrix's fp32 bounds against one process
(``tests.test_layout_parity``), and the routing the ranks record (counted from the experts' ``top_k_index``)
adds up to the reference's. Models without an ep plan, or with experts ep does not divide, are refused by name.
"""
from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

import lab  # noqa: E402
from kernels.contract.config_rules import ConfigError  # noqa: E402
from kernels.model.family import model_fields  # noqa: E402
from kernels.parallel.warm_meshes import unkept_group_count  # noqa: E402
from lab.run.own_models import own_config  # noqa: E402
from tests.config_draws import RecordingPool  # noqa: E402
from tests.layout_runs import Runs, assert_trains_like_one_process, layout_runs, reference_of, tier  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2, intermediate_size=32)
EXPERTS = 4


def mixtral(**changes):
    return transformers.MixtralConfig(**{**SIZES, "num_local_experts": EXPERTS, "router_jitter_noise": 0.0, **changes})


def qwen3_moe(**changes):
    return transformers.Qwen3MoeConfig(**{**SIZES, "num_experts": EXPERTS, "moe_intermediate_size": 32, **changes})


MODELS = {"mixtral": mixtral, "qwen3-moe": qwen3_moe}
BASE = {"global_batch": 8, "steps": 3, "lr": 1e-2, "seed": 0}
LAYOUTS = {  # id -> (model, the run's layout fields; ranks beyond world_size sit the run out)
    "mixtral-ep2-dp2": ("mixtral", {"dp": 4, "ep": 2}),
    "mixtral-ep2": ("mixtral", {"dp": 2, "ep": 2, "world_size": 2}),
    "mixtral-ep4": ("mixtral", {"dp": 4, "ep": 4}),  # one expert per rank
    "qwen3-moe-ep2-dp2": ("qwen3-moe", {"dp": 4, "ep": 2}),
    "qwen3-moe-ep2": ("qwen3-moe", {"dp": 2, "ep": 2, "world_size": 2}),
    "qwen3-moe-ep2-dp2-zero3": ("qwen3-moe", {"dp": 4, "ep": 2, "zero": 3}),
    # Activation checkpointing runs the experts' all-to-alls again in backward (not counted as routing again).
    "mixtral-ep2-dp2-ac-microbatches": ("mixtral", {"dp": 4, "ep": 2, "activation_checkpointing": True,
                                                    "microbatches": 2}),
}
FAST: set[str] = set()  # each case imports transformers on the ranks first: the slow tier's

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _config(layout: str) -> dict:
    model, fields = LAYOUTS[layout]
    if "world_size" not in fields:  # the driver accepts it on the pool's 4 ranks (and sends nothing here)
        lab.Experiment(RecordingPool(), MODELS[model](), lab.Parallel(**fields), **BASE)
    return {**BASE, "model": model_fields(own_config(MODELS[model]())), **fields}


@pytest.fixture(scope="module")
def trained(cluster) -> Runs:
    return layout_runs(cluster, _config)


@pytest.mark.parametrize("layout", [tier(k, FAST) for k in LAYOUTS])
def test_hf_experts_split_over_ranks_train_like_one_process(trained, layout):
    cfg, results = trained(layout)
    assert_trains_like_one_process(cfg, results)
    for res in results:
        held = {name: info["local_shape"] for name, info in res["layout"]["params"].items() if ".experts." in name}
        assert sorted(held) == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                for p in ("down_proj", "gate_up_proj")]
        assert all(shape[0] == EXPERTS // cfg["ep"] for shape in held.values()), held  # E/ep whole experts


@pytest.mark.parametrize("layout", [tier(k, FAST) for k in LAYOUTS])
def test_the_ranks_record_the_routing_of_one_process(trained, layout):
    """Per step and MoE block: the ranks' assignments summed over ranks equal the reference's; the block is
    dropless (kept == assigned) and no aux loss is recorded (the model computes none without router logits)."""
    cfg, results = trained(layout)
    rows = [row for res in results for row in res["routing_steps"]]
    mine: dict[tuple[int, str], list[int]] = {}
    for row in rows:
        summed = mine.setdefault((row["step"], row["layer"]), [0] * EXPERTS)
        mine[row["step"], row["layer"]] = [a + b for a, b in zip(summed, row["assigned"])]
    theirs = {(row["step"], row["layer"]): row["assigned"] for row in reference_of(cfg)["routing"]}
    assert set(theirs) == {(s, f"model.layers.{i}.mlp") for s in range(cfg["steps"]) for i in range(2)}
    assert mine == theirs
    assert all(row["kept"] == row["assigned"] and row["aux_loss"] is None for row in rows)
    tokens = cfg["global_batch"] * cfg["model"]["seq_len"]
    assert sum(row["tokens"] for row in rows if row["step"] == 0 and row["layer"] == "model.layers.0.mlp") == tokens
    assert {(row["rank"], row["ep_rank"], row["ep"]) for row in rows} == \
        {(rank, rank % cfg["ep"], cfg["ep"]) for rank in range(len(results))}


# --- a rank whose experts receive no token ------------------------------------------------------------------------
def _hf_experts_no_token_reaches() -> dict:
    """On every rank of the pool: a tiny Mixtral's first experts module, one expert per rank, handed every token
    for expert 0 only. Returns this rank's local gradient beside the gathered one's error against one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from kernels.model.own_model import build_own
    from kernels.parallel.expert_parallel import ExpertGradSync, apply_ep
    from kernels.parallel.mesh import destroy_mesh_groups

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", torch.arange(world).view(1, world), mesh_dim_names=("ep_replicate", "ep"))
    try:
        spec = model_fields(own_config(mixtral(num_local_experts=world)))
        whole, sharded = build_own(spec, seed=0), build_own(spec, seed=0)
        experts = apply_ep(sharded, mesh)
        x = torch.randn(4 * world, SIZES["hidden_size"], generator=torch.Generator().manual_seed(0))
        index, weights = torch.zeros(4 * world, 2, dtype=torch.long), torch.full((4 * world, 2), 0.5)
        mine = slice(4 * rank, 4 * rank + 4)
        whole.model.layers[0].mlp.experts(x, index, weights).pow(2).mean().backward()
        sharded.model.layers[0].mlp.experts(x[mine], index[mine], weights[mine]).pow(2).mean().backward()
        ExpertGradSync({k: p for k, p in experts.items() if ".layers.0." in k}, mesh, world)()
        grad = sharded.model.layers[0].mlp.experts.down_proj.grad
        return {"local": None if grad is None else grad.to_local().abs().max().item(),
                "error": (grad.full_tensor() - whole.model.layers[0].mlp.experts.down_proj.grad).abs().max().item()}
    finally:
        destroy_mesh_groups(mesh)


def test_hf_experts_no_token_reaches_get_a_zero_gradient_not_none(cluster):
    out = cluster.run(_hf_experts_no_token_reaches)
    assert out[0]["local"] > 0 and [o["local"] for o in out[1:]] == [0.0, 0.0, 0.0]
    assert max(o["error"] for o in out) < 1e-6
    assert cluster.run(unkept_group_count) == [1] * cluster.world_size


# --- refused before launch, and again on the ranks ----------------------------------------------------------------
@pytest.mark.parametrize("config, parallel, rule", [
    (lambda: transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2), {"dp": 4, "ep": 2}, "ep-plan"),
    (lambda: mixtral(num_local_experts=6), {"dp": 4, "ep": 4}, "ep-experts"),
    (lambda: qwen3_moe(), {"dp": 2, "tp": 2, "ep": 2}, "ep-combination"),
], ids=["dense-llama-has-no-ep-plan", "experts-not-divisible", "with-tp"])
def test_layouts_ep_cannot_run_on_an_hf_model_are_refused_by_name(config, parallel, rule):
    pool = RecordingPool()
    with pytest.raises(ConfigError) as err:
        lab.Experiment(pool, config(), lab.Parallel(**parallel))
    assert pool.calls == [], "a refused config reached the ranks"
    assert err.value.rules == (rule,), str(err.value)


def test_the_ranks_check_the_ep_plan_and_the_expert_split_too():
    """A config that skipped the driver's checks still meets [ep-plan] and [ep-experts] where the rank applies
    expert parallelism, read from the model it built."""
    from kernels.model.own_model import build_own
    from kernels.parallel.expert_parallel import apply_ep

    class EpOfTwo:  # what apply_ep asks of the mesh before it touches a process group
        def size(self, axis: int) -> int:
            return 2

    odd = build_own(model_fields(own_config(mixtral(num_local_experts=3))), seed=0)
    with pytest.raises(ConfigError, match=r"\[ep-experts\] experts=3 must be divisible by ep=2"):
        apply_ep(odd, EpOfTwo())
    dense = build_own(model_fields(own_config(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))), seed=0)
    with pytest.raises(ConfigError, match=r"\[ep-plan\] .* \(Qwen3Config\) has no base_model_ep_plan"):
        apply_ep(dense, EpOfTwo())
