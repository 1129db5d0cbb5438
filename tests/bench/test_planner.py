"""The capacity planner: profile fitting, the event model's limiting cases, the recommendation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

import pytest

from bench.planner import add_arguments, main
from splitserve.planner import (
    Profile,
    cheapest,
    fit_profile,
    load_profile_from_results,
    load_rows,
    recommend,
    simulate,
)
from splitserve.slo import SLO

# 0.1 s per prefill: one prefill worker serves at most 10 req/s.
SLOW_PREFILL = Profile(prefill_base_s=0.02, prefill_per_token_s=0.0008, decode_base_s=0.005,
                       decode_per_seq_s=0.0005, overhead_s=0.002)


def _rows(batch: float | None = None) -> list[dict]:
    rows = []
    for i, p in enumerate(range(100, 2100, 100)):
        b = batch if batch is not None else 1 + i % 4
        prefill, queue = 0.01 + 0.0002 * p, 0.001 * (i % 3)
        rows.append({"ok": True, "prompt_tokens": p, "output_tokens": 50, "prefill_s": prefill,
                     "queue_s": queue, "ttft_s": queue + prefill + 0.003,
                     "tpot_s": 0.004 + 0.0015 * b, "batch": b, "transfer_s": 0.001,
                     "decode_s": 0.2, "e2e_s": 1.0})
    rows.append({"ok": False, "prompt_tokens": 5, "output_tokens": 0, "prefill_s": 99.0})
    return rows


def test_fit_profile_recovers_linear_coefficients() -> None:
    prof = fit_profile(_rows())
    assert prof.prefill_base_s == pytest.approx(0.01)
    assert prof.prefill_per_token_s == pytest.approx(0.0002)
    assert prof.decode_base_s == pytest.approx(0.004)
    assert prof.decode_per_seq_s == pytest.approx(0.0015)
    assert prof.overhead_s == pytest.approx(0.003)
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_fit_profile_without_batch_spread_uses_median_and_clips_negatives() -> None:
    rows = [{k: v for k, v in r.items() if k != "batch"} for r in _rows()]
    prof = fit_profile(rows)
    assert prof.decode_per_seq_s == 0.0
    assert prof.decode_base_s == pytest.approx(median(r["tpot_s"] for r in rows if r["ok"]))
    # prefill time falling with length is noise: slope 0, mean time
    rows = [{"prompt_tokens": p, "prefill_s": 1.0 - p / 1000, "tpot_s": 0.01,
             "output_tokens": 2} for p in (100, 200, 300)]
    prof = fit_profile(rows)
    assert prof.prefill_per_token_s == 0.0 and prof.prefill_base_s == pytest.approx(0.8)
    assert prof.overhead_s == 0.0
    with pytest.raises(ValueError):
        fit_profile([{"ok": False}])


def test_load_profile_from_results_estimates_batch_per_run(tmp_path: Path) -> None:
    reqs = [{"ok": True, "prompt_tokens": p, "output_tokens": 11, "prefill_s": 0.001 * p,
             "queue_s": 0.0, "ttft_s": 0.001 * p + 0.002, "decode_s": 0.5,
             "tpot_s": None} for p in (10, 20, 30, 40)]
    # 4 requests x 0.5 s decoding over 1 s on 1 decode worker = batch 2; over 0.5 s = batch 4
    runs = [{"rate": r, "duration": d,
             "requests": [{**q, "tpot_s": 0.01 + 0.002 * b} for q in reqs]}
            for r, d, b in ((1.0, 1.0, 2), (2.0, 0.5, 4))]
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"num_prefill_workers": 1, "num_decode_workers": 1, "runs": runs}))
    assert sorted({r["batch"] for r in load_rows([path])}) == [2.0, 4.0]
    prof = load_profile_from_results([path])
    assert prof.decode_base_s == pytest.approx(0.01)
    assert prof.decode_per_seq_s == pytest.approx(0.002)
    assert prof.prefill_per_token_s == pytest.approx(0.001)
    assert prof.overhead_s == pytest.approx(0.002)


def test_zero_load_is_pure_service_time() -> None:
    r = simulate(SLOW_PREFILL, 1, 1, rate=0.01, workload=[(100, 10)], num_requests=50)
    ttft_ms = (SLOW_PREFILL.prefill_s(100) + SLOW_PREFILL.overhead_s) * 1e3
    tpot_ms = SLOW_PREFILL.step_s(1) * 1e3
    assert r.ttft_ms.p50 == pytest.approx(ttft_ms) and r.ttft_ms.p99 == pytest.approx(ttft_ms)
    assert r.tpot_ms.p50 == pytest.approx(tpot_ms) and r.tpot_ms.p99 == pytest.approx(tpot_ms)
    assert r.e2el_ms.p90 == pytest.approx(ttft_ms + 9 * tpot_ms)
    assert r.attainment == 1.0


def test_prefill_overload_queues_without_bound_and_a_second_worker_fixes_it() -> None:
    wl = [(100, 10)]
    one = simulate(SLOW_PREFILL, 1, 2, rate=15, workload=wl, num_requests=600)
    two = simulate(SLOW_PREFILL, 2, 2, rate=15, workload=wl, num_requests=600)
    longer = simulate(SLOW_PREFILL, 1, 2, rate=15, workload=wl, num_requests=1200)
    # at 15/s against 10/s capacity the wait grows by 1/30 s per request: the n-th waits n/30 s
    assert one.ttft_ms.p90 > 15_000 and longer.ttft_ms.p90 > 1.6 * one.ttft_ms.p90
    assert two.ttft_ms.p90 < 1_000 and two.ttft_ms.p90 < one.ttft_ms.p90 / 20
    slo = SLO(ttft_s=1.0)
    assert simulate(SLOW_PREFILL, 1, 2, 15, wl, slo, num_requests=600).attainment < 0.3
    assert simulate(SLOW_PREFILL, 2, 2, 15, wl, slo, num_requests=600).attainment > 0.95


def test_colocated_prefills_inflate_tpot_disaggregation_does_not() -> None:
    # 0.22 s prefills of 2000-token prompts against ~11 ms decode steps, 4 workers either way
    prof = Profile(prefill_base_s=0.02, prefill_per_token_s=0.0001, decode_base_s=0.010,
                   decode_per_seq_s=0.0005, overhead_s=0.002)
    wl = [(2000, 64)]
    disagg = simulate(prof, 2, 2, rate=6, workload=wl, num_requests=400)
    colo = simulate(prof, 0, 0, rate=6, workload=wl, num_requests=400, num_colocated=4)
    assert disagg.tpot_ms.p90 < 1.1 * prof.step_s(4) * 1e3  # decode never waits on a prefill
    assert colo.tpot_ms.p90 > 1.6 * disagg.tpot_ms.p90  # every stall lands on a decode batch
    assert colo.tpot_ms.mean > 1.3 * disagg.tpot_ms.mean
    assert colo.ttft_ms.p90 < disagg.ttft_ms.p90  # the price: 4 prefill-capable workers, not 2
    with pytest.raises(ValueError):
        simulate(prof, 1, 0, rate=1, workload=wl, num_colocated=2)


def test_recommend_returns_the_cheapest_config_meeting_the_target() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.015)
    wl = [(100, 40), (120, 60)]
    rows = recommend(SLOW_PREFILL, 15, wl, slo, target=0.9, max_workers=4, num_requests=300)
    assert len(rows) == 6 + 4  # 1P1D 1P2D 2P1D 1P3D 2P2D 3P1D and 1..4 colocated
    best = cheapest(rows, 0.9)
    assert best is not None and best.attainment >= 0.9
    assert best == next(r for r in rows if r.attainment >= 0.9)  # rows are cheapest first
    assert all(r.attainment < 0.9 for r in rows if r.workers < best.workers)
    assert best.num_prefill >= 2 and not best.num_colocated
    assert [r.workers for r in rows] == sorted(r.workers for r in rows)
    assert cheapest(rows, 1.01) is None


def test_same_seed_same_prediction() -> None:
    wl = [(50, 20), (500, 5), (1500, 100)]
    a = simulate(SLOW_PREFILL, 1, 1, 5, wl, SLO(ttft_s=0.5), seed=3, num_requests=200)
    b = simulate(SLOW_PREFILL, 1, 1, 5, wl, SLO(ttft_s=0.5), seed=3, num_requests=200)
    c = simulate(SLOW_PREFILL, 1, 1, 5, wl, SLO(ttft_s=0.5), seed=4, num_requests=200)
    assert a == b and a != c


def test_cli_fits_saves_and_recommends(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [{k: v for k, v in r.items() if k != "batch"} for r in _rows()]
    res = tmp_path / "res.json"
    res.write_text(json.dumps({"num_decode_workers": 1, "runs": [
        {"rate": 1.0, "duration": 10.0, "requests": rows}]}))
    p = argparse.ArgumentParser()
    add_arguments(p)
    saved = tmp_path / "profile.json"
    a = p.parse_args(["--profile", str(res), "--rate", "2", "--slo", "ttft=2s,tpot=100ms",
                      "--max-workers", "3", "--num-requests", "100", "--save-profile", str(saved)])
    assert main(a) == 0
    out = capsys.readouterr().out
    # a light load: one colocated worker is cheapest, and its prefill stalls still fit the SLO
    assert "assumptions:" in out and "1P2D" in out and "recommendation: 1x colocated" in out
    a = p.parse_args(["--profile-json", str(saved), "--rate", "2", "--slo", "ttft=2s",
                      "--input-len", "100", "--output-len", "8", "--max-workers", "2",
                      "--num-requests", "50"])
    assert main(a) == 0
    assert Profile.from_dict(json.loads(saved.read_text())) == fit_profile(load_rows([res]))
    a = p.parse_args(["--profile-json", str(saved), "--rate", "2", "--slo", "ttft=2s"])
    assert main(a) == 2  # a saved profile carries no workload


def test_cli_refuses_an_slo_without_units(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--slo ttft=2000` once meant 2 s; now it names its unit or is refused, not read as 2000 s."""
    saved = tmp_path / "profile.json"
    saved.write_text(json.dumps(SLOW_PREFILL.to_dict()))
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--profile-json", str(saved), "--rate", "2", "--slo", "ttft=2000",
                      "--input-len", "100", "--output-len", "8"])
    assert main(a) == 2
    assert "SLO value '2000' has no unit: write 2000ms or 2s" in capsys.readouterr().err
