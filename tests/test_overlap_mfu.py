"""Overlap of communication with compute, model FLOPs and MFU (docs/design.md#overlap-model-flops-and-mfu).

The FLOPs formula is checked against torch's own ``FlopCounterMode`` on one process (the attention
through SDPA's math backend, whose matmuls the counter sees; the CPU's fused kernel it does not
count) and against Narayanan et al.'s closed form. The overlap is checked on real ranks: none by
construction under naive data parallelism (every all-reduce after backward, each waited for at
once), some under ZeRO-3 with FSDP2 prefetching the next block's all-gather.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import lab
from kernels.model.family import build_model, model_fields
from kernels.model.gpt import GPTConfig, loss_fn
from kernels.model.llama import LlamaConfig
from kernels.watch.overlap import StepSpans
from lab.measure.throughput import flops_per_token, peak_flops
from lab.run.run_result import RunResult
from widgets.training_dashboard import speed


@pytest.mark.parametrize("cfg", [GPTConfig(layers=2, d_model=64, heads=4, vocab=128, seq_len=32, d_ff=96),
                                 LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=128, seq_len=32)])
def test_model_flops_equal_torch_flop_counter(cfg):
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab, (3, cfg.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn(model(tokens), tokens).backward()
    assert flops_per_token(model_fields(cfg))[0] * tokens.numel() == counter.get_total_flops()


def test_narayanan_closed_form_and_recomputation():
    B, s, l, h, V = 8, 128, 6, 96, 500
    model = model_fields(GPTConfig(layers=l, d_model=h, heads=4, vocab=V, seq_len=s))  # d_ff = 4h
    plain, same, _ = flops_per_token(model)
    assert plain == same
    assert math.isclose(plain * B * s, 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h)))
    # Full recomputation runs each block's forward again, not the head's: Narayanan's 96 and V/(16lh).
    _, recomputed, _ = flops_per_token(model, recompute=True)
    assert math.isclose(recomputed * B * s, 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)))
    _, selective, _ = flops_per_token(model, recompute="selective")  # only the attention core again
    assert math.isclose(selective - plain, 4 * l * s * h)


def test_own_model_is_six_n_without_attention():
    model, hardware, formula = flops_per_token({"family": "module", "seq_len": 16}, params=1000)
    assert model == hardware == 6000 and "no attention term" in formula
    with pytest.raises(ValueError, match="params"):
        flops_per_token({"family": "hf", "seq_len": 16})


def test_peaks_by_gpu_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12  # torch's name for the SXM part
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L40S") == 362e12 and peak_flops("NVIDIA L4") == 121e12
    assert peak_flops(2.5e12) == 2.5e12 and peak_flops(None) is None
    with pytest.raises(ValueError, match="no known peak"):
        peak_flops("Apple M2")


def test_overlap_is_compute_and_comm_at_once():
    spans = StepSpans()
    spans.compute += [(0.0, 1.0), (2.0, 3.0)]  # forward, backward
    spans.comm += [(0.5, 1.2), (2.5, 4.0)]  # a prefetch under the forward, a bucket under the backward's end
    spans.blocked += [(2.6, 2.8)]  # a wait inside backward is not compute
    busy, overlap = spans.close(0.0, 3.5, still_open=[3.4])
    assert math.isclose(busy, 1.8) and math.isclose(overlap, 0.5 + 0.3)
    assert spans.close(3.5, 4.0) == (0.0, 0.0)  # the next step starts empty


def _result(step_s: float, waits: list[dict]) -> RunResult:
    model = model_fields(GPTConfig(layers=2, d_model=64, heads=4, vocab=128, seq_len=32))
    return RunResult(config={"model": model, "global_batch": 8, "strategy": {}}, losses=[1.0, 1.0, 1.0],
                     step_times=[[9.0, step_s, step_s], [9.0, step_s / 2, step_s]], layout=[{}, {}], step_waits=waits)


def test_mfu_is_achieved_over_peak():
    waits = [{"rank": r, "step": s, "wait_s": 0.2, "busy_s": 0.5, "overlap_s": 0.1} for r in (0, 1) for s in (0, 1, 2)]
    res = _result(0.25, waits)
    speed_record = res.throughput(1e12)
    per_step = flops_per_token(res.config["model"])[0] * 8 * 32
    assert speed_record.step_s == 0.25  # the slowest rank, the first step left out
    assert speed_record.tokens_per_s == 8 * 32 / 0.25 and speed_record.model_flops_per_step == per_step
    assert math.isclose(speed_record.mfu, per_step / 0.25 / (1e12 * 2))
    assert speed_record.overlap_s == 0.1 and speed_record.comm_s == 0.2
    assert res.throughput().mfu is None
    assert RunResult.from_json(res.to_json()).throughput("H100").peak_flops == 989e12


def test_dashboard_speed_from_progress_records():
    rows = [{"rank": r, "step": s, "steps": 3, "loss": 1.0, "step_s": 0.1, "tokens_per_s": 1000.0 - 100 * r,
             "collective_s": 0.0, "compute_s": 0.1, "memory_bytes": 0, "memory_kind": "rss", "sent_at": 0.0}
            for r in (0, 1) for s in (0, 1, 2)]
    assert speed(rows, 2) == {"tokens_per_s": 900.0, "mfu": None}  # the slowest rank sets the pace
    assert math.isclose(speed(rows, 2, flops_per_token=1e6, peak_flops=1e9)["mfu"], 900 * 1e6 / 2e9)


def _naive_dp_waits(cfg: dict, steps: int = 3) -> list[dict]:
    """Naive data parallelism under the rank watch: forward, backward, then one blocking all-reduce per gradient."""
    import torch.distributed as dist

    from kernels.contract.run_config import RunConfig
    from kernels.model.family import model_config
    from kernels.train.data import dataset, shard_batch
    from kernels.train.data_parallel_naive import average_gradients_naive
    from kernels.watch.rank_watch import RankWatch

    run = RunConfig.from_options(cfg)
    model = build_model(model_config(run))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = RankWatch([])
    with watch.patched():
        watch.attach([model], optimizer)
        for step in range(steps):
            watch.begin_step(step)
            inputs, targets = dataset(run).global_batch(step, run.global_batch)
            x, y = shard_batch(inputs, targets, dist.get_rank(), dist.get_world_size())
            loss_fn(model(x), y).backward()
            average_gradients_naive(model)
            optimizer.step()
            optimizer.zero_grad()
        return [w.to_dict() for w in watch.finish()]


MODEL = lab.GPT(layers=4, d_model=128, heads=4, vocab=256, seq_len=64)


@pytest.mark.slow
def test_naive_data_parallel_hides_nothing(cluster):
    cfg = lab.Experiment(cluster, MODEL, lab.Parallel(dp=4), global_batch=16, steps=3).config()
    waits = [w for rank in cluster.run(_naive_dp_waits, cfg) for w in rank if w["step"] > 0]
    assert all(w["wait_s"] > 0 and w["busy_s"] > 0 for w in waits)
    assert all(w["overlap_s"] < 0.02 * w["step_s"] for w in waits), waits


@pytest.mark.slow
def test_fsdp_prefetch_overlaps_and_reports_mfu(cluster):
    res = lab.Experiment(cluster, MODEL, lab.Parallel(dp=4, zero=3), global_batch=16, steps=3).run()
    later = [w for w in res.step_waits if w["step"] > 0]
    assert all(0 < w["overlap_s"] <= min(w["busy_s"], w["wait_s"]) + 1e-9 for w in later), later
    speed_record = res.throughput(peak_flops=1e12)
    assert speed_record.overlap_s > 0 and speed_record.devices == 4
    assert math.isclose(speed_record.mfu, speed_record.flops_per_s / 4e12)
    assert res.dashboard(peak_flops=1e12).speed["mfu"] > 0


@pytest.mark.slow
def test_the_live_dashboard_shows_mfu_for_the_labs_own_model(cluster):
    handle = lab.Experiment(cluster, MODEL, lab.Parallel(dp=4), global_batch=16, steps=4).start()
    view = handle.dashboard(peak_flops=1e12)
    handle.wait()
    assert view.speed["tokens_per_s"] > 0 and view.speed["mfu"] > 0, view.speed
