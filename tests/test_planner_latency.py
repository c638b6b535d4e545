"""The α–β cost of a collective (docs/design.md#collective-latency): the fit, the planner's latency term,
the bench's α."""
from __future__ import annotations

import random

import pytest

from kernels.contract.measure_records import BenchRecord
from lab.measure.bench import fit_records, planner_links, with_fits
from lab.planning.plan_latency import DEFAULT_ALPHA_US, collective_seconds, collective_steps, fit_alpha_beta
from lab.planning.plan_math import GB, busbw_factor
from lab.planning.planner import plan

SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
# The shape of benchmarks/hosts.py: 16 TP calls of 256 KiB per step, TP across the two "nodes".
HOSTS_MODEL = {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 128, "vocab": 64, "seq_len": 128}
TP_ACROSS = {"dp": 2, "tp": 2, "mesh_order": ("pp", "tp", "dp")}


def _timings(op: str, n: int, alpha: float, busbw: float, noise: float = 0.0, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(s, collective_seconds(op, n, s, busbw, alpha) * (1 + rng.uniform(-noise, noise))) for s in SIZES]


def test_ring_steps_follow_thakur_rabenseifner_and_gropp():
    assert [collective_steps("all_reduce", n) for n in (1, 2, 4, 8)] == [0, 2, 6, 14]
    assert collective_steps("all_gather", 8) == collective_steps("reduce_scatter", 8) == 7
    assert collective_steps("p2p", 2) == 1
    assert collective_steps("all_to_all", 4) == 3  # pairwise exchange: one partner per step
    with pytest.raises(ValueError):
        collective_steps("gather", 4)


@pytest.mark.parametrize("op,n", [("all_reduce", 2), ("all_reduce", 4), ("all_gather", 4), ("send_recv", 2)])
def test_the_fit_recovers_alpha_and_busbw_from_exact_timings(op, n):
    fit = fit_alpha_beta(_timings(op, n, alpha=300e-6, busbw=60e6), op, n, "inter")
    assert fit.alpha_s == pytest.approx(300e-6, rel=1e-9) and fit.busbw == pytest.approx(60e6, rel=1e-9)
    assert fit.rel_rms < 1e-9 and not fit.through_origin and fit.points == len(SIZES)
    assert fit.seconds(1 << 18) == pytest.approx(collective_seconds(op, n, 1 << 18, 60e6, 300e-6))


def test_the_fit_stays_close_under_five_percent_noise():
    fit = fit_alpha_beta(_timings("all_reduce", 2, alpha=500e-6, busbw=600e6, noise=0.05, seed=3), "all_reduce", 2)
    assert fit.alpha_s == pytest.approx(500e-6, rel=0.15) and fit.busbw == pytest.approx(600e6, rel=0.15)
    assert fit.rel_rms < 0.05


def test_a_shapers_burst_gives_no_negative_latency():
    # Small calls faster than the rate (a token bucket's burst): the free line would cross below 0.
    points = [(s, s / 1e8 * (0.5 if s < 1 << 16 else 1.0)) for s in SIZES]
    fit = fit_alpha_beta(points, "all_reduce", 2)
    assert fit.through_origin and fit.alpha_s == 0 and fit.busbw > 0


def test_one_size_or_no_growth_cannot_be_fitted():
    with pytest.raises(ValueError):
        fit_alpha_beta([(4096, 1e-3), (4096, 2e-3)], "all_reduce", 2)
    with pytest.raises(ValueError):
        fit_alpha_beta([(4096, 2e-3), (1 << 20, 1e-3)], "all_reduce", 2)


def test_the_planners_many_small_tp_all_reduces_pay_the_latency_term():
    alpha_us, bw = 300.0, 0.06
    p = plan(HOSTS_MODEL, gpus=4, gpus_per_node=2, parallel=TP_ACROSS, global_batch=16, dtype="fp32",
             inter_bw=bw, inter_alpha_us=alpha_us)
    inter = p.link("inter")
    steps = sum(e.count * collective_steps(e.op, e.group_size) for e in p.comm if e.link == "inter")
    assert steps == 23  # 11 all-reduces of 2 steps (2 + 2 per block, 3 at the ends), the logits' all-gather of 1
    assert inter.alpha_us == alpha_us and inter.latency_s == pytest.approx(steps * alpha_us * 1e-6)
    assert inter.time_s == pytest.approx(inter.latency_s + inter.wire_bytes / (bw * GB))
    no_latency = plan(HOSTS_MODEL, gpus=4, gpus_per_node=2, parallel=TP_ACROSS, global_batch=16, dtype="fp32",
                      inter_bw=bw, inter_alpha_us=0.0).link("inter")
    assert no_latency.latency_s == 0 and inter.time_s - no_latency.time_s == pytest.approx(inter.latency_s)


def test_the_default_latency_is_the_stated_one():
    p = plan(HOSTS_MODEL, gpus=4, gpus_per_node=2, parallel=TP_ACROSS, global_batch=16, dtype="fp32")
    assert p.link("intra").alpha_us == DEFAULT_ALPHA_US["intra"]
    assert p.link("inter").alpha_us == DEFAULT_ALPHA_US["inter"]
    assert "us" in p.render_text()


def _records(link: str, alpha: float, busbw: float, world: int = 2) -> list[BenchRecord]:
    f = busbw_factor("all_reduce", world)
    out = []
    for size, t in _timings("all_reduce", world, alpha, busbw):
        out.append(BenchRecord(op="all_reduce", size_bytes=size, world=world, iters=5, seconds=t,
                               algbw=size / t, busbw=size / t * f, factor=f, link=link))
    return out


def test_bench_records_carry_their_series_fit_and_feed_the_planner():
    records = with_fits(_records("intra", 400e-6, 600e6) + _records("inter", 200e-6, 60e6)
                        + [_records("", 1e-3, 1e8, world=4)[0]])  # one size: no fit
    fitted = [r for r in records if r.link]
    assert all(r.alpha_s is not None and r.fit_busbw is not None for r in fitted)
    assert records[-1].alpha_s is None and records[-1].fit_busbw is None
    assert set(fit_records(records)) == {("all_reduce", "intra", 2), ("all_reduce", "inter", 2)}
    links = planner_links(records)
    assert links == pytest.approx({"intra_bw": 0.6, "intra_alpha_us": 400.0,
                                   "inter_bw": 0.06, "inter_alpha_us": 200.0})
    fed = plan(HOSTS_MODEL, gpus=4, gpus_per_node=2, parallel=TP_ACROSS, global_batch=16, **links)
    assert fed.link("inter").alpha_us == pytest.approx(200.0) and fed.link("intra").bandwidth_gbps == pytest.approx(0.6)


def test_one_hosts_sweep_stands_for_the_intra_link():
    links = planner_links(_records("", 100e-6, 1e9, world=4))
    assert links == pytest.approx({"intra_bw": 1.0, "intra_alpha_us": 100.0})


def test_bench_collectives_reports_alpha_on_the_pool(cluster):
    from lab.measure.bench import bench_collectives
    records = bench_collectives(cluster, sizes=(1 << 12, 1 << 16, 1 << 20), ops=("all_reduce",), iters=3)
    assert len(records) == 3
    fit = fit_records(records).get(("all_reduce", "", 4))
    if fit is None:  # noise left the times not growing with size: then no record claims a fit
        assert all(r.alpha_s is None for r in records)
        return
    assert all(r.alpha_s == fit.alpha_s >= 0 and r.fit_busbw == fit.busbw > 0 for r in records)
    assert planner_links(records)["intra_alpha_us"] == pytest.approx(fit.alpha_s * 1e6)
