"""bench/goodput.py scores a drive against a second SLO from its per-request rows."""

from __future__ import annotations

from bench.goodput import attainment, summarize
from splitserve.slo import SLO


def _req(ok: bool, ttft_s: float | None, tpot_s: float | None) -> dict:
    return {"ok": ok, "ttft_s": ttft_s, "tpot_s": tpot_s, "e2e_s": 5.0}


def test_a_second_slo_scores_each_request_as_the_first_would() -> None:
    requests = [_req(True, 0.5, 0.020), _req(True, 2.0, 0.020), _req(True, 0.5, 0.060),
                _req(False, 0.1, 0.001), _req(True, None, None), _req(True, 2.5, None)]
    assert attainment(requests, SLO(ttft_ms=1000, tpot_ms=25)) == 1 / 6
    # The seed's looser SLO: the slow first token (2 s), the slow steps (60 ms) and a
    # one-token answer (no TPOT) pass; a failure and a request with no token never do.
    assert attainment(requests, SLO(ttft_ms=3000, tpot_ms=100)) == 4 / 6
    assert attainment([], SLO(ttft_ms=1)) == 0.0


def test_goodput_follows_the_chosen_attainment() -> None:
    row = {"median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_tpot_ms": 1.0, "p99_tpot_ms": 1.0}
    rows = [{"deployment": "1p1d", "driver": "splitserve", "rate": rate, **row,
             "attainment": tight, "attainment_also": loose}
            for rate, tight, loose in ((2, 0.95, 1.0), (4, 0.5, 0.92), (6, 0.1, 0.6))]
    assert "goodput     2" in summarize(rows, ["1p1d"], ["splitserve"], 0.9)
    assert "goodput     4" in summarize(rows, ["1p1d"], ["splitserve"], 0.9, "attainment_also")
