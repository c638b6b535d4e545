"""Training hygiene: clipping by the global norm, a learning-rate schedule, shuffling epoch by epoch.

Each feature has a fast test against torch's own (``clip_grad_norm_``, ``LinearLR`` and
``CosineAnnealingLR``, ``DistributedSampler.set_epoch``) and a test that it changes the
one-process reference, so a feature that did nothing would fail. On the pool, one run per
layout (DP4, ZeRO-3 DP4, TP2×DP2) clips, schedules (a different schedule each) and shuffles a
token file over three epochs, and must equal one process; the DP4 run also saves, and a run
resumed from its middle goes on with the schedule at that step; a held ``lab.Training`` steps
2 + 2 as one process steps 4.
"""
from __future__ import annotations

import copy
import math
import threading
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR
from torch.utils.data import DistributedSampler

import lab
from kernels.contract.config_rules import ConfigError
from kernels.contract.run_config import RunConfig
from kernels.contract.training_hygiene import LRSchedule, ScheduleKind
from kernels.model.family import build_model, model_config, model_loss
from kernels.parallel.warm_meshes import unkept_group_count
from kernels.train.data import SyntheticTokens, dataset
from kernels.train.entry import train_rank
from kernels.train.lr_schedule import ScheduledLR, warmup_cosine_factor
from kernels.train.reference import train_reference
from kernels.train.token_data import TokenWindows
from kernels.train.train_loop import grad_norm
from kernels.train.update_rules import clip_to_norm
from lab.run.data_sources import Tokens
from lab.run.training_hygiene import schedule_record
from tests.config_draws import RecordingPool
from tests.layout_runs import assert_trains_like_one_process, reference_of

TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
BASE = {"model": TINY, "global_batch": 8, "steps": 4, "lr": 1e-2, "seed": 0}
CLIP = 0.5  # the tiny GPT's gradient norm is 1.2-2.2 over these steps: every step clips


def _tokens(windows: int = 12) -> torch.Tensor:
    """A learnable stream of ``windows`` windows of 16 (+1): 4 steps of 8 samples visit it 2.7 times (3 epochs)."""
    return SyntheticTokens(64, 16 * windows, seed=5).global_batch(0, 1)[0].flatten()[: 16 * windows + 1]


@pytest.fixture(scope="module")
def token_spec() -> dict:
    return Tokens(_tokens()).spec().to_dict()


def _gpt_with_grads() -> torch.nn.Module:
    run = RunConfig(model=TINY)
    model, loss = build_model(model_config(run)), model_loss(model_config(run))
    inputs, targets = dataset(run).global_batch(0, 8)
    loss(model(inputs), targets).backward()
    return model


# --- grad_clip ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_norm", [CLIP, 100.0], ids=["clips", "leaves-alone"])
def test_rank_clipping_scales_gradients_as_torch_clip_grad_norm_does(max_norm, one_thread):
    ours = _gpt_with_grads()
    theirs = copy.deepcopy(ours)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        q.grad = p.grad.clone()
    norm = grad_norm(ours, torch.device("cpu"))
    clip_to_norm(ours, norm, max_norm)
    total = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert float(norm) == pytest.approx(float(total), rel=1e-6)  # float64 sums of squares against float32 norms
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)
    after = float(grad_norm(ours, torch.device("cpu")))
    assert after == pytest.approx(min(max_norm, float(total)), rel=1e-5)


def test_clipping_changes_the_reference_and_records_each_norm_before_clipping(one_thread):
    plain, clipped = train_reference(RunConfig(**BASE)), train_reference(RunConfig(**BASE, grad_clip=CLIP))
    assert clipped["grad_norms"][0] == plain["grad_norms"][0] > CLIP  # the first step's norm, taken before clipping
    assert clipped["losses"][-1] != pytest.approx(plain["losses"][-1], rel=1e-4)


# --- lr_schedule ----------------------------------------------------------------------------------------------

def _lrs(spec: LRSchedule, steps: int, lr: float = 0.1) -> list[float]:
    scheduled = ScheduledLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr), spec, lr)
    scheduled.seek(0)
    out = []
    for _ in range(steps):
        out.append(scheduled.lr)
        scheduled.step()
    return out


def _torch_lrs(make, steps: int, lr: float = 0.1) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler, out = make(optimizer), []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_warmup_then_cosine_follows_torchs_linear_lr_then_cosine_annealing_lr():
    warmup, total, floor = 3, 10, 0.1
    ours = _lrs(LRSchedule(ScheduleKind.WARMUP_COSINE, warmup_steps=warmup, total_steps=total, min_factor=floor), 13)
    rising = _torch_lrs(lambda o: LinearLR(o, start_factor=1 / (warmup + 1), total_iters=warmup), warmup + 1)
    falling = _torch_lrs(lambda o: CosineAnnealingLR(o, T_max=total - warmup, eta_min=0.1 * floor), total - warmup + 1)
    assert ours[:warmup + 1] == pytest.approx(rising, rel=1e-12) and ours[warmup] == 0.1  # the peak
    assert ours[warmup:total + 1] == pytest.approx(falling, rel=1e-9)
    assert ours[total:] == pytest.approx([0.1 * floor] * 3)  # flat after total_steps, not back up the cosine


@pytest.mark.parametrize("spec", [LRSchedule(ScheduleKind.STEP, step_size=2, gamma=0.5),
                                  LRSchedule(ScheduleKind.WARMUP_COSINE, warmup_steps=2, total_steps=6),
                                  schedule_record(lambda step: 1 / (1 + step))], ids=["step", "cosine", "function"])
def test_a_schedule_placed_at_step_k_gives_the_lr_of_k_steps_taken(spec):
    taken = _lrs(spec, 7)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduled = ScheduledLR(optimizer, spec, 0.1)
    for k in (4, 1, 6):  # also backwards: a new layout or a load places it anew
        optimizer.param_groups[0]["lr"] = 123.0  # what a loaded checkpoint's settings may hold
        scheduled.seek(k)
        assert scheduled.lr == taken[k]
    assert _lrs(LRSchedule(ScheduleKind.STEP, step_size=2, gamma=0.5), 5) == [0.1, 0.1, 0.05, 0.05, 0.025]


def test_a_schedule_changes_the_reference_and_its_lrs_are_recorded(one_thread):
    run = RunConfig(**BASE, lr_schedule=LRSchedule(ScheduleKind.STEP, step_size=1, gamma=0.5))
    scheduled, plain = train_reference(run), train_reference(RunConfig(**BASE))
    assert scheduled["lrs"] == [1e-2, 5e-3, 2.5e-3, 1.25e-3] and plain["lrs"] == [1e-2] * 4
    assert scheduled["losses"][0] == plain["losses"][0] and scheduled["losses"][-1] != plain["losses"][-1]


def test_a_function_schedule_travels_pickled_and_bad_ones_are_refused_by_name():
    assert schedule_record(lambda s: 0.5 ** s).kind is ScheduleKind.FUNCTION
    lock = threading.Lock()
    for bad in ("cosine", lambda s: 1 / 0, lambda s: math.nan, lambda s: -1.0, lambda s: lock and 1.0,
                lab.WarmupCosine(warmup_steps=5, total_steps=3), lab.StepLR(step_size=0)):
        with pytest.raises(ConfigError) as caught:
            RunConfig(**BASE, lr_schedule=schedule_record(bad, 4))
        assert caught.value.rules == ("lr-schedule",), bad


# --- shuffle and epochs ---------------------------------------------------------------------------------------

def test_each_epoch_is_distributed_samplers_permutation_for_set_epoch():
    windows = TokenWindows(torch.arange(1, 162), seq_len=16, seed=7)  # 10 windows
    sampler = DistributedSampler(list(range(10)), num_replicas=1, rank=0, shuffle=True, seed=7)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert windows.order(epoch).tolist() == list(sampler)
    assert windows.order(0).tolist() != windows.order(1).tolist()
    in_order = TokenWindows(torch.arange(1, 162), seq_len=16, seed=7, shuffle=False)
    assert in_order.order(2).tolist() == list(range(10))
    firsts = torch.cat([in_order.global_batch(step, 4)[0][:, 0] for step in range(3)])  # steps 0-2 cross an epoch
    assert firsts.tolist() == [1 + 16 * (i % 10) for i in range(12)] and in_order.epoch(2, 4) == 0
    assert windows.epoch(3, 4) == 1


def test_shuffle_reaches_the_data_every_rank_and_the_reference_read(token_spec):
    def first_batch(**shuffle) -> list:
        return dataset(RunConfig(**BASE, data=token_spec, **shuffle)).global_batch(0, 8)[0].tolist()
    assert first_batch(shuffle=True) == first_batch() != first_batch(shuffle=False)  # None: the data's default


def test_shuffle_is_refused_where_the_data_has_no_epochs(token_spec):
    for shuffle, data in ((True, {}), (False, {}), (True, {"kind": "task", "task": "modular_addition", "modulus": 7})):
        with pytest.raises(ConfigError) as caught:
            RunConfig(**BASE, shuffle=shuffle, data=data or None) if data else RunConfig(**BASE, shuffle=shuffle)
        assert caught.value.rules == ("shuffle",)
    RunConfig(**BASE, shuffle=False, data=token_spec)


def test_hygiene_options_are_refused_by_name_before_launch():
    cases = {"grad-clip": {"grad_clip": 0}, "shuffle": {"shuffle": "yes"},
             "spike-guard": {"spike_guard": lab.SpikeGuard(action="rollback")},
             "lr-schedule": {"lr_schedule": lab.StepLR(step_size=2, gamma=-1.0)}}
    for rule, options in cases.items():
        pool = RecordingPool()
        with warnings.catch_warnings(), pytest.raises(ConfigError) as caught:
            warnings.simplefilter("ignore", lab.LayoutWarning)
            lab.Experiment(pool, lab.GPT(**TINY), lab.Parallel(dp=4), **options)
        assert rule in caught.value.rules and pool.calls == [], (rule, str(caught.value))


# --- on the pool ------------------------------------------------------------------------------------------------

LAYOUTS = {  # each layout with another schedule
    "ddp4": ({"dp": 4}, LRSchedule(ScheduleKind.WARMUP_COSINE, warmup_steps=2, total_steps=4, min_factor=0.1)),
    "zero3-dp4": ({"dp": 4, "zero": 3}, LRSchedule(ScheduleKind.STEP, step_size=1, gamma=0.5)),
    "tp2-dp2": ({"dp": 2, "tp": 2}, schedule_record(lambda step: 0.8 ** step)),
}


@pytest.fixture(scope="module")
def hygiene_runs(cluster, token_spec, tmp_path_factory):
    """Each layout's run (clipping, its schedule, shuffled tokens over three epochs) once; DP4's also saves."""
    runs, saves = {}, tmp_path_factory.mktemp("hygiene-ckpt")

    def get(layout: str) -> tuple[dict, list[dict]]:
        if layout not in runs:
            fields, schedule = LAYOUTS[layout]
            cfg = {**BASE, **fields, "data": token_spec, "shuffle": True, "grad_clip": CLIP,
                   "lr_schedule": schedule.to_dict(), "return_params": True}
            if layout == "ddp4":
                cfg.update(checkpoint_dir=str(saves), checkpoint_every=2)
            runs[layout] = cfg, cluster.run(train_rank, cfg)
            assert cluster.run(unkept_group_count) == [1] * cluster.world_size, "sub-groups left behind"
        return runs[layout]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clipping_a_schedule_and_shuffled_epochs_train_like_one_process(hygiene_runs, layout):
    cfg, results = hygiene_runs(layout)
    ref = assert_trains_like_one_process({k: v for k, v in cfg.items() if not k.startswith("checkpoint")}, results)
    assert all(r["lrs"] == pytest.approx(ref["lrs"], rel=1e-12) for r in results)
    assert ref["lrs"][0] != ref["lrs"][-1] and min(ref["grad_norms"]) > CLIP  # every step clipped, the lr moved
    assert TokenWindows(torch.zeros(12 * 16 + 1), 16).epoch(cfg["steps"] - 1, 8) == 2  # the run saw three epochs


@pytest.mark.slow
def test_a_run_resumed_from_its_middle_goes_on_with_the_schedule_and_the_epochs_at_that_step(cluster, hygiene_runs):
    cfg, whole = hygiene_runs("ddp4")
    resumed = cluster.run(train_rank, {**cfg, "checkpoint_dir": None, "checkpoint_every": None,
                                       "resume_from": cfg["checkpoint_dir"] + "/step_000002"})
    assert resumed[0]["first_step"] == 2
    assert resumed[0]["lrs"] == whole[0]["lrs"][2:]
    assert resumed[0]["losses"] == whole[0]["losses"][2:]  # same layout: bit for bit
    ref = reference_of({**cfg, "checkpoint_dir": None, "checkpoint_every": None,
                        "resume_from": cfg["checkpoint_dir"] + "/step_000002"})
    assert resumed[0]["losses"] == pytest.approx(ref["losses"], rel=1e-4) and ref["lrs"] == resumed[0]["lrs"]


@pytest.mark.slow
def test_a_held_training_clips_schedules_and_shuffles_across_calls_as_one_process(cluster, token_spec, one_thread):
    # The guard's window (step 1's loss) lives on the ranks between the calls: step 2's NaN is judged against it.
    options = dict(global_batch=8, lr=1e-2, grad_clip=CLIP, shuffle=True, data=Tokens(_tokens()),
                   lr_schedule=lab.WarmupCosine(warmup_steps=1, total_steps=4, min_factor=0.2),
                   spike_guard=lab.SpikeGuard(window=1), faults=[lab.PoisonBatch(step=2, kind="nan")])
    with lab.Training(cluster, lab.GPT(**TINY), lab.Parallel(dp=2, tp=2), **options) as held:
        first, second = held.step(2), held.step(2)
    ref = lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=2, tp=2), steps=4, **options).reference()
    assert first.losses + second.losses == pytest.approx(ref.losses, rel=1e-4, nan_ok=True)
    assert first.lrs + second.lrs == pytest.approx(ref.lrs, rel=1e-12) and len(set(ref.lrs)) == 4
    def skips(result):
        return [(e["step"], e["reason"], e["median"]) for e in result.spikes]
    assert skips(first) == [] and skips(second) == [(2, "nan", pytest.approx(first.losses[1], rel=1e-6))]
    assert skips(ref) == [(2, "nan", pytest.approx(first.losses[1], rel=1e-4))]
