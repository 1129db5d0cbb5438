"""Metric math on hand-built timestamps: every number below is computed by hand."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.metrics import (
    RequestResult,
    max_goodput_rate,
    streams_at_first_token,
    summarize,
)
from bench.pool_options import handoff
from splitserve.slo import SLO


def _runs() -> list[RequestResult]:
    return [
        # ttft 100 ms, e2e 300 ms, 4 tokens -> tpot 200/3 ms, itls 50 and 150 ms
        RequestResult(True, 10.0, [10.1, 10.15, 10.3], [1, 2, 1], 10.3, 100, 4,
                      server={"queue_s": 0.01, "prefill_s": 0.05}),
        # one token: ttft 300 ms, no tpot, no itl
        RequestResult(True, 20.0, [20.3], [1], 20.3, 50, 1),
        # ttft 200 ms, e2e 400 ms, 2 tokens -> tpot 200 ms, itl 200 ms
        RequestResult(True, 30.0, [30.2, 30.4], [1, 1], 30.4, 10, 2, server={"queue_s": 0.03}),
        # failed: excluded from latency and token totals, counted against attainment
        RequestResult(False, 40.0, [], [], 41.0, 7, 0, error="boom", server={"queue_s": 5.0}),
    ]


def test_request_properties() -> None:
    r1, r2, r3, r4 = _runs()
    assert r1.ttft == pytest.approx(0.1)
    assert r1.e2e == pytest.approx(0.3)
    assert r1.tpot == pytest.approx(0.2 / 3)
    assert r1.itls == pytest.approx([0.05, 0.15])
    assert r2.tpot is None and r2.itls == []
    assert r3.tpot == pytest.approx(0.2)
    assert r4.ttft is None and r4.tpot is None and r4.e2e == pytest.approx(1.0)


def test_summary_exact_values() -> None:
    s = summarize(_runs(), duration=10.0, slo=SLO(ttft_s=0.25, tpot_s=0.1))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (160, 7)
    assert s["duration"] == 10.0
    assert s["request_throughput"] == pytest.approx(0.3)
    assert s["output_throughput"] == pytest.approx(0.7)
    assert s["total_token_throughput"] == pytest.approx(16.7)
    # ttft ms [100, 300, 200]; numpy linear percentile on sorted [100, 200, 300]
    assert s["mean_ttft_ms"] == pytest.approx(200)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert s["p50_ttft_ms"] == pytest.approx(200)
    assert s["p90_ttft_ms"] == pytest.approx(280)
    assert s["p99_ttft_ms"] == pytest.approx(298)
    # tpot ms [66.67, 200] (the 1-token request has none)
    assert s["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert s["median_tpot_ms"] == pytest.approx(400 / 3)
    assert s["p90_tpot_ms"] == pytest.approx(200 / 3 + 0.9 * 400 / 3)
    # itl ms pooled over requests [50, 150, 200]
    assert s["mean_itl_ms"] == pytest.approx(400 / 3)
    assert s["median_itl_ms"] == pytest.approx(150)
    assert s["p90_itl_ms"] == pytest.approx(190)
    # e2el ms [300, 300, 400]
    assert s["mean_e2el_ms"] == pytest.approx(1000 / 3)
    assert s["median_e2el_ms"] == pytest.approx(300)
    assert s["p99_e2el_ms"] == pytest.approx(398)
    # only request 1 meets ttft<=250 and tpot<=100: r2 ttft 300, r3 tpot 200, r4 failed
    assert s["request_goodput"] == pytest.approx(0.1)
    assert s["slo_attainment"] == pytest.approx(0.25)
    # server phases over successful requests that report them
    assert s["mean_queue_ms"] == pytest.approx(20)
    assert s["mean_prefill_ms"] == pytest.approx(50)


def test_summary_without_slo_and_custom_percentiles() -> None:
    s = summarize(_runs(), duration=2.0, percentiles=(25, 99.9))
    assert s["request_goodput"] is None and s["slo_attainment"] is None
    assert s["p25_ttft_ms"] == pytest.approx(150)
    assert "p99.9_ttft_ms" in s and "p50_ttft_ms" not in s


def test_one_token_output_meets_tpot_and_failed_never_meets() -> None:
    runs = _runs()
    slo = SLO(tpot_s=0.05)
    assert [slo.meets(r) for r in runs] == [False, True, False, False]
    assert SLO().meets(runs[0]) and not SLO().meets(runs[3])
    assert not SLO(e2el_s=0.35).meets(runs[2]) and SLO(e2el_s=0.400001).meets(runs[2])
    no_chunk = RequestResult(True, 0.0, [], [], 1.0, 3, 0)
    assert not SLO(ttft_s=1e6).meets(no_chunk)


def test_empty_results_give_zeros_not_nan() -> None:
    s = summarize([], duration=1.0, slo=SLO(ttft_s=0.001))
    assert s["completed"] == 0 and s["failed"] == 0
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "std", "p50", "p99"):
            assert s[f"{k}_{m}_ms"] == 0.0
    assert s["slo_attainment"] == 0.0 and s["request_goodput"] == 0.0
    only_failed = summarize([_runs()[3]], duration=1.0, slo=SLO(ttft_s=0.001))
    assert only_failed["mean_ttft_ms"] == 0.0 and only_failed["slo_attainment"] == 0.0
    assert "mean_queue_ms" not in only_failed


def test_summary_rejects_bad_duration() -> None:
    for d in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            summarize(_runs(), d)


def test_server_key_does_not_clobber_client_metric() -> None:
    r = RequestResult(True, 0.0, [0.1], [1], 0.1, 1, 1, server={"ttft_s": 0.5})
    s = summarize([r], 1.0)
    assert s["mean_ttft_ms"] == pytest.approx(100)
    assert s["mean_server_ttft_ms"] == pytest.approx(500)


def test_slo_parse_takes_each_value_with_its_unit() -> None:
    assert SLO.parse("ttft=500ms,tpot=50ms,e2el=3s") == SLO(0.5, 0.05, 3.0)
    assert SLO.parse("ttft=0.5s") == SLO.parse("ttft=500ms") == SLO(ttft_s=0.5)
    assert SLO.parse("tpot=12.5ms") == SLO(tpot_s=0.0125)
    assert SLO.parse("TTFT=2S tpot=0.2MS") == SLO(ttft_s=2.0, tpot_s=0.0002)
    assert SLO.parse("ttft:500ms tpot:50ms") == SLO(0.5, 0.05)  # vLLM's --goodput spelling
    for bad in ("ttfb=5ms", "ttft", "ttft=abcms", "ttft=1s,ttft=2s", "ttft=-1ms", "ttft=0s",
                "e2e=5s", "ttft=5m", "ttft=5min", "ttft=infs", "ttft=ms"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


@pytest.mark.parametrize(("text", "hint"), [("ttft=500", "write 500ms or 0.5s"),
                                            ("tpot:50", "write 50ms or 0.05s"),
                                            ("ttft=1s,e2el=3000", "write 3000ms or 3s")])
def test_slo_parse_refuses_a_bare_number(text: str, hint: str) -> None:
    """A bare number used to mean milliseconds: it fails loudly rather than mean seconds."""
    with pytest.raises(ValueError, match="has no unit: " + hint):
        SLO.parse(text)


@pytest.mark.parametrize("slo", [SLO(0.5, 0.05), SLO(ttft_s=1.0, tpot_s=0.1),
                                 SLO(0.5, None, 3.0), SLO(tpot_s=0.0125), SLO(ttft_s=1 / 3),
                                 SLO(e2el_s=1234.5), SLO(tpot_s=1e-7), SLO()])
def test_slo_str_is_what_parse_reads_back(slo: SLO) -> None:
    assert SLO.parse(str(slo)) == slo


def test_slo_str_writes_ms_below_a_second() -> None:
    assert str(SLO(0.5, 0.05)) == "ttft=500ms,tpot=50ms"
    assert str(SLO(ttft_s=1.0, tpot_s=0.1, e2el_s=5.0)) == "ttft=1s,tpot=100ms,e2el=5s"


@given(st.floats(1e-9, 1e9))
def test_slo_str_round_trips_any_target(seconds: float) -> None:
    slo = SLO(seconds, seconds, seconds)
    assert SLO.parse(str(slo)) == slo


def test_max_goodput_rate() -> None:
    pts = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.7), (8.0, 0.2)]
    assert max_goodput_rate(pts) == 2.0
    assert max_goodput_rate(pts, target=0.7) == 4.0
    assert max_goodput_rate(pts, target=1.0) == 1.0
    assert max_goodput_rate([(1.0, 0.5)]) is None and max_goodput_rate([]) is None
    with pytest.raises(ValueError):
        max_goodput_rate(pts, target=0)


@given(
    start=st.floats(0, 1e4),
    gaps=st.lists(st.floats(1e-4, 10), min_size=1, max_size=20),
    tail=st.floats(0, 1),
    extra=st.integers(0, 5),
)
def test_timing_identities(start: float, gaps: list[float], tail: float, extra: int) -> None:
    times, t = [], start
    for g in gaps:
        t += g
        times.append(t)
    n_tokens = len(times) + extra
    r = RequestResult(True, start, times, [1] * len(times), times[-1] + tail, 5, n_tokens)
    assert r.ttft == pytest.approx(gaps[0])
    assert r.ttft + sum(r.itls) == pytest.approx(times[-1] - start)
    assert len(r.itls) == len(times) - 1
    if n_tokens > 1:
        assert r.tpot * (n_tokens - 1) == pytest.approx(r.e2e - r.ttft)
    # Loosening a target never turns a met SLO into a miss.
    slo = SLO(ttft_s=r.ttft + 1e-3, e2el_s=r.e2e + 1e-3)
    assert slo.meets(r) and SLO(ttft_s=r.ttft * 2 + 1e-3).meets(r)


def _stream(first: float, last: float, ok: bool = True) -> RequestResult:
    times = [first, (first + last) / 2, last] if ok else []
    return RequestResult(ok, first - 0.1, times, [1] * len(times), last, 10, len(times))


def test_streams_at_first_token_counts_the_others_streaming_then() -> None:
    rs = [_stream(0.0, 5.0),  # alone
          _stream(1.0, 2.0),  # the first is streaming
          _stream(3.0, 4.0),  # the first again (the second ended at 2.0)
          _stream(6.0, 7.0),  # alone again: the first ended at 5.0
          _stream(0.5, 9.0, ok=False)]  # failed: no first token, and counts for no one
    assert streams_at_first_token(rs) == [0, 1, 1, 0, None]


def test_handoff_splits_the_gap_by_an_idle_or_busy_decode_side() -> None:
    rows = [{"ok": True, "first_gap_s": g, "step_s": 0.01, "transfer_s": None,
             "streams_at_first_token": n}
            for g, n in ((0.020, 0), (0.030, 0), (0.100, 1), (0.120, 3), (0.5, None))]
    h = handoff(rows)
    assert h["median_first_gap_idle_ms"] == pytest.approx(25.0) and h["idle_requests"] == 2
    assert h["median_first_gap_busy_ms"] == pytest.approx(110.0) and h["busy_requests"] == 2
    assert h["median_first_gap_ms"] == pytest.approx(100.0)  # all five
