"""A pipeline stage's shapes known before it runs (``kernels.parallel.stage_shapes``) against torch's inference.

On 4 spawned gloo ranks the real loop (``kernels.train.entry.train_rank``) runs one step with torch
inferring every stage's shapes, while the examples the lab would have given are recorded; the two
must agree on every stage of every rank. A second step with the examples given must then train alike:
the same losses. Layouts where the lab does not know the shapes get no examples.
"""
from __future__ import annotations

import pytest

from kernels.contract.strategy import resolve_strategy
from kernels.model.gpt import GPTConfig
from kernels.parallel.stage_shapes import shapes_known, stage_examples
from tests.spawned_ranks import pooled_runner

WORLD = 4
GPT = {"layers": 4, "d_model": 16, "heads": 2, "vocab": 32, "seq_len": 8}
LLAMA = {"family": "llama", "layers": 4, "hidden": 16, "heads": 2, "kv_heads": 2, "ffn": 32, "vocab": 32, "seq_len": 8}
CASES = {
    "PP2×TP2": {"pp": 2, "tp": 2},
    "PP2×TP2 sequence parallel, Llama": {"pp": 2, "tp": 2, "sequence_parallel": True, "model": LLAMA},
    "PP2×DP2 ZeRO-3": {"pp": 2, "dp": 2, "zero": 3},
    "PP4 GPipe": {"pp": 4, "schedule": "gpipe"},
    "PP2×TP2 ZBV": {"pp": 2, "tp": 2, "schedule": "zbv", "stages_per_rank": 2},
    "PP2×DP2 interleaved": {"pp": 2, "dp": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 2},
}
FAST = ()  # 10 s for the cheapest case, a pool of its own: every case is slow (CI runs them all)


def shapes_against_torch(case: dict) -> dict:
    """On one rank: each local stage's examples and torch's inferred metadata compared, and the losses of a
    step with torch inferring against a step with the examples given."""
    from torch.distributed.pipelining import stage as torch_stage
    from torch.distributed.pipelining._utils import extract_tensor_metas

    import kernels.train.run_build as run_build
    from kernels.train.entry import train_rank

    ours, inferred, give = {}, {}, {"examples": False}

    def recording(*args, **kwargs):
        examples = stage_examples(*args, **kwargs)
        ours[args[3]] = {key: extract_tensor_metas(value if isinstance(value, tuple) else (value,),
                                                   allow_none=True) for key, value in examples.items()}
        return examples if give["examples"] else {}

    def inferring(stage):
        inferred[stage.stage_index] = stage._stage_meta
        return cleanup(stage)

    cleanup = torch_stage.PipelineStage._post_metadata_inference_cleanup
    run_build.stage_examples, torch_stage.PipelineStage._post_metadata_inference_cleanup = recording, inferring
    try:
        run = {"model": GPT, "microbatches": 4, "global_batch": 8, "steps": 2, "lr": 1e-2, "return_params": False,
               "record_grad_norm": False, **case}
        losses_inferred = train_rank(run)["losses"]
        give["examples"] = True
        inferred_before = dict(inferred)
        losses_given = train_rank(run)["losses"]
    finally:
        run_build.stage_examples, torch_stage.PipelineStage._post_metadata_inference_cleanup = stage_examples, cleanup
    problems = []
    for sid, meta in inferred_before.items():
        mine = ours.get(sid, {})
        pairs = {"input_args": meta.inputs, "output_args": meta.outputs, "input_grads": meta.input_grads,
                 "output_grads": meta.output_grads}
        for key, theirs in pairs.items():
            if theirs is not None and mine.get(key) != theirs:  # torch infers no grads where none cross
                problems.append(f"stage {sid} {key}: ours {mine.get(key)} torch's {theirs}")
    return {"stages": sorted(inferred_before), "problems": problems, "inferred_again": sorted(set(inferred)
            - set(inferred_before)) or len(inferred) != len(inferred_before),
            "losses": (losses_inferred, losses_given)}


@pytest.fixture(scope="module")
def ranks():
    yield from pooled_runner(shapes_against_torch, lambda case: WORLD)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in CASES])
def test_the_examples_are_what_torch_infers_and_train_alike(ranks, name):
    by_rank = ranks(CASES[name])
    for rank, out in by_rank.items():
        assert out["stages"], f"rank {rank} inferred no stage"
        assert not out["problems"], f"rank {rank}: " + "; ".join(out["problems"])
        assert not out["inferred_again"], f"rank {rank}: torch inferred again with the examples given"
        inferred, given = out["losses"]
        assert inferred == given, f"rank {rank}: losses {inferred} with torch inferring, {given} with examples"


def test_layouts_whose_shapes_the_lab_does_not_know_get_no_examples():
    plain = resolve_strategy(pp=2, microbatches=2)
    assert shapes_known(GPTConfig(**GPT), plain, rank_batch=4)
    assert not shapes_known(GPTConfig(**GPT, experts=4), plain, rank_batch=4)  # a MoE
    assert not shapes_known(GPTConfig(**GPT), resolve_strategy(pp=2, microbatches=2, mixed_precision="bf16"), 4)
    assert not shapes_known(GPTConfig(**GPT), resolve_strategy(pp=2, dp=2, cp=2, microbatches=2), 4)
    assert not shapes_known(GPTConfig(**GPT), plain, rank_batch=3)  # micro-batches of unequal size
    assert stage_examples(GPTConfig(**GPT, experts=4), plain, 4, stage=0, num_stages=2, tp_mesh=None) == {}
