"""Training saved under one layout goes on under another exactly where it stopped.

Each case trains 4 AdamW steps (one case plain SGD) under layout A with ``checkpoint_every=2`` (the
uninterrupted run, saving at step 2), then resumes from step 2 under layout B for steps
3-4. B's losses and final gathered parameters must match A's at the layout parity
matrix's bounds (``tests.test_layout_parity``: losses rtol 1e-4, parameters atol 1e-5 or,
with two blocks per pipeline stage, the update-norm bound); resumed under A itself they
must be bit for bit equal, as the model, the AdamW state (step counts included), the RNG
state and the data position are all restored. One case resumes the one-process
reference from a 4-rank checkpoint; the 8-rank case also changes the world size.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import lab
from tests.test_layout_parity import FP32, PIPELINE_NORM, _check_params

MODEL = {"layers": 4, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
STEPS, SAVED_AT = 4, 2

LAYOUTS = {
    "dp4": {"dp": 4},
    "zero1-dp4": {"dp": 4, "zero": 1},
    "zero2-dp4": {"dp": 4, "zero": 2},
    "zero3-dp4": {"dp": 4, "zero": 3},
    "tp2-dp2-zero3": {"dp": 2, "tp": 2, "zero": 3},
    "dp2-tp2": {"dp": 2, "tp": 2},
    "pp2-tp2-1f1b": {"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2},
    "pp2-dp2-gpipe": {"pp": 2, "dp": 2, "schedule": "gpipe", "microbatches": 2},
    "pp2-tp2-interleaved": {"pp": 2, "tp": 2, "schedule": "interleaved_1f1b", "microbatches": 4},
    "pp2-dp2-tp2": {"pp": 2, "dp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2},
    "zero3-dp4-cpu-offload": {"dp": 4, "zero": 3, "cpu_offload": True},
    "hsdp-2x2": {"dp": 4, "fsdp_strategy": "hybrid", "dp_replicate": 2},
}
EIGHT_RANKS = {"pp2-dp2-tp2"}

# (A, B): the matrix
# The fast tier keeps two relayouts (DP -> TP×FSDP, FSDP -> PP×TP); the rest of the matrix is slow.
PAIRS = [("dp4", "tp2-dp2-zero3"), pytest.param("zero3-dp4", "pp2-tp2-1f1b", marks=pytest.mark.slow),  # 4 s
         pytest.param("pp2-dp2-gpipe", "zero1-dp4", marks=pytest.mark.slow),
         pytest.param("pp2-tp2-interleaved", "zero2-dp4", marks=pytest.mark.slow),
         pytest.param("zero3-dp4-cpu-offload", "hsdp-2x2", marks=pytest.mark.slow),
         pytest.param("pp2-dp2-tp2", "dp2-tp2", marks=pytest.mark.slow, id="pp2-dp2-tp2-8-ranks-to-dp2-tp2")]
SAME = ["dp4", "zero3-dp4", "zero1-dp4", "pp2-dp2-gpipe"]  # ZeRO-1: each rank saves and loads its own partition

pytestmark = pytest.mark.usefixtures("one_thread")


def _experiment(pool, layout: str, **kwargs) -> lab.Experiment:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.LayoutWarning)
        return lab.Experiment(pool, lab.GPT(**MODEL), lab.Parallel(**LAYOUTS[layout]), steps=STEPS, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """layout -> (the uninterrupted run, its checkpoint directory); each A is trained once per module."""
    runs: dict[str, tuple[lab.RunResult, str]] = {}

    def get(pool, layout: str) -> tuple[lab.RunResult, str]:
        if layout not in runs:
            root = str(tmp_path_factory.mktemp(layout))
            result = _experiment(pool, layout, checkpoint_dir=root, checkpoint_every=SAVED_AT).run(return_params=True)
            runs[layout] = result, root
        return runs[layout]

    return get


def _gathered(result: lab.RunResult) -> dict[str, torch.Tensor]:
    """Every parameter, whole, from whichever rank holds it (pipeline ranks hold their stages')."""
    out: dict[str, torch.Tensor] = {}
    for params in result.params.values():
        out.update({k: torch.tensor(v) for k, v in params.items() if k not in out})
    return out


def _init() -> dict[str, torch.Tensor]:
    from kernels.model.gpt import build_gpt
    from kernels.model.family import model_config
    from kernels.contract.run_config import RunConfig

    return dict(build_gpt(model_config(RunConfig(model=MODEL))).named_parameters())


def _pool(request, layout: str):
    return request.getfixturevalue("cluster8" if layout in EIGHT_RANKS else "cluster")


def _step_two(root: str) -> lab.Checkpoint:
    found = {c.step: c for c in lab.checkpoints(root)}
    assert sorted(found) == [SAVED_AT, STEPS], sorted(found)
    return found[SAVED_AT]


@pytest.mark.parametrize("a, b", PAIRS)
def test_resumed_under_another_layout_matches_the_uninterrupted_run(request, saved, a, b):
    whole, root = saved(_pool(request, a), a)
    resumed = _experiment(_pool(request, b), b, resume_from=_step_two(root)).run(return_params=True)
    assert resumed.steps_ran == [3, 4]
    assert resumed.losses == pytest.approx(whole.losses[SAVED_AT:], rel=1e-4)
    tol = PIPELINE_NORM if "pp" in LAYOUTS[a] or "pp" in LAYOUTS[b] else FP32
    expected, init = _gathered(whole), _init()
    for rank, params in resumed.params.items():
        _check_params(rank, {k: v for k, v in params.items()}, expected, tol, init)
    assert _gathered(resumed).keys() == expected.keys()


@pytest.mark.parametrize("layout", SAME)
def test_resumed_under_the_same_layout_is_bit_for_bit(request, saved, layout):
    pool = _pool(request, layout)
    whole, root = saved(pool, layout)
    resumed = _experiment(pool, layout, resume_from=root + "/step_000002").run(return_params=True)
    assert resumed.losses == whole.losses[SAVED_AT:]  # exact
    assert resumed.grad_norms == whole.grad_norms[SAVED_AT:]
    assert resumed.params == whole.params


def test_the_one_process_reference_resumes_from_a_four_rank_checkpoint(request, saved):
    whole, root = saved(_pool(request, "zero3-dp4"), "zero3-dp4")
    reference = _experiment(request.getfixturevalue("cluster"), "dp4", resume_from=_step_two(root))
    resumed = reference.reference(return_params=True)
    assert resumed.steps_ran == [3, 4]
    assert resumed.losses == pytest.approx(whole.losses[SAVED_AT:], rel=1e-4)
    _check_params(0, resumed.params[0], _gathered(whole), FP32, _init())


def test_a_checkpoint_lists_its_step_layout_world_and_bytes(request, saved):
    _, root = saved(_pool(request, "zero3-dp4"), "zero3-dp4")
    found = lab.checkpoints(root)
    assert [c.step for c in found] == [SAVED_AT, STEPS]
    assert all(c.world_size == 4 and c.layout["dp"] == 4 and c.layout["zero"] == 3 and c.bytes > 0 for c in found)
    assert found[0].saved_at <= found[1].saved_at


@pytest.mark.slow  # fast tier: one case per capability; measured 9 s; test_training checks async saves too
def test_an_asynchronous_save_resumes_bit_for_bit_too(request, saved, tmp_path):
    pool = _pool(request, "zero3-dp4")
    whole, _ = saved(pool, "zero3-dp4")
    root = str(tmp_path / "async")
    run = _experiment(pool, "zero3-dp4", checkpoint_dir=root, checkpoint_every=SAVED_AT, checkpoint_async=True).run()
    assert run.losses == whole.losses  # saving in the background changes nothing in the training
    resumed = _experiment(pool, "zero3-dp4", resume_from=_step_two(root)).run(return_params=True)
    assert resumed.losses == whole.losses[SAVED_AT:]
    assert resumed.params == whole.params


@pytest.mark.slow  # fast tier: one case per capability; measured 11.3 s
def test_plain_sgd_resumes_under_another_layout_and_bit_for_bit_under_its_own(request, tmp_path):
    pool = request.getfixturevalue("cluster")
    root = str(tmp_path / "sgd")
    whole = _experiment(pool, "zero1-dp4", optimizer="sgd", checkpoint_dir=root,
                        checkpoint_every=SAVED_AT).run(return_params=True)
    again = _experiment(pool, "zero1-dp4", optimizer="sgd", resume_from=_step_two(root)).run(return_params=True)
    assert again.losses == whole.losses[SAVED_AT:] and again.params == whole.params
    moved = _experiment(pool, "tp2-dp2-zero3", optimizer="sgd", resume_from=_step_two(root)).run(return_params=True)
    assert moved.losses == pytest.approx(whole.losses[SAVED_AT:], rel=1e-4)
    expected, init = _gathered(whole), _init()
    for rank, params in moved.params.items():
        _check_params(rank, params, expected, FP32, init)
