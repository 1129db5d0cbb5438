"""bench/goodput.py scores a drive against a second SLO from its per-request rows."""

from __future__ import annotations

import argparse

import pytest

from bench.goodput import attainment, summarize
from bench.vs_vllm import check_workload, workload_arguments
from splitserve.slo import SLO


def _req(ok: bool, ttft_s: float | None, tpot_s: float | None) -> dict:
    return {"ok": ok, "ttft_s": ttft_s, "tpot_s": tpot_s, "e2e_s": 5.0}


def test_a_second_slo_scores_each_request_as_the_first_would() -> None:
    requests = [_req(True, 0.5, 0.020), _req(True, 2.0, 0.020), _req(True, 0.5, 0.060),
                _req(False, 0.1, 0.001), _req(True, None, None), _req(True, 2.5, None)]
    assert attainment(requests, SLO(ttft_s=1.0, tpot_s=0.025)) == 1 / 6
    # The seed's looser SLO: the slow first token (2 s), the slow steps (60 ms) and a
    # one-token answer (no TPOT) pass; a failure and a request with no token never do.
    assert attainment(requests, SLO.parse("ttft=3s,tpot=100ms")) == 4 / 6
    assert attainment([], SLO(ttft_s=0.001)) == 0.0


def test_goodput_follows_the_chosen_attainment() -> None:
    row = {"median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_tpot_ms": 1.0, "p99_tpot_ms": 1.0}
    rows = [{"deployment": "1p1d", "driver": "splitserve", "rate": rate, **row,
             "attainment": tight, "attainment_also": loose}
            for rate, tight, loose in ((2, 0.95, 1.0), (4, 0.5, 0.92), (6, 0.1, 0.6))]
    assert "goodput     2" in summarize(rows, ["1p1d"], ["splitserve"], 0.9)
    assert "goodput     4" in summarize(rows, ["1p1d"], ["splitserve"], 0.9, "attainment_also")


def test_slo_flags_are_seconds_and_the_ms_spellings_are_refused(
        capsys: pytest.CaptureFixture) -> None:
    ap = argparse.ArgumentParser()
    workload_arguments(ap)
    a = ap.parse_args(["--drivers", "splitserve", "--slo-ttft-s", "2", "--slo-tpot-s", "0.015"])
    check_workload(ap, a)
    assert (a.slo_ttft_s, a.slo_tpot_s) == (2.0, 0.015)
    with pytest.raises(SystemExit):
        check_workload(ap, ap.parse_args(["--slo-tpot-ms", "15"]))
    assert "--slo-tpot-ms is gone: durations are seconds, give --slo-tpot-s 0.015" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_workload(ap, ap.parse_args(["--slo-ttft-s", "0"]))
    assert "SLO ttft_s must be a finite number > 0" in capsys.readouterr().err
