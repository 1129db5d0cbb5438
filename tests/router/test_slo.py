"""SLO-aware admission's arithmetic on a hand-driven clock (end to end: tests/e2e/test_slo.py)."""

from __future__ import annotations

import grpc
import pytest

from router.generation import grpc_trailers
from router.http import api_error
from router.outcome import outcome_of
from router.slo import DecodeMeter, Overloaded, PrefillMeter, TpotAdmission, TtftAdmission


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def served(meter: PrefillMeter, clock: Clock, n: int, seconds: float) -> None:
    meter.start(n)
    clock.t += seconds
    meter.answered(n)


def test_the_meter_predicts_nothing_until_it_has_seen_a_few_requests() -> None:
    clock = Clock()
    meter = PrefillMeter(clock)
    for _ in range(2):
        served(meter, clock, 1000, 0.5)
        assert meter.rate() is None and meter.predict_ttft(1000) is None
    served(meter, clock, 1000, 0.5)
    assert meter.rate() == pytest.approx(2000.0)  # tokens per busy second
    assert meter.predict_ttft(1000) == pytest.approx(0.5)


def test_idle_time_is_not_counted_and_the_queue_ahead_is() -> None:
    clock = Clock()
    meter = PrefillMeter(clock)
    for _ in range(3):
        served(meter, clock, 1000, 0.5)
        clock.t += 60.0  # idle between requests: not part of the rate
    assert meter.rate() == pytest.approx(2000.0)
    meter.start(3000)  # a queue of 3,000 prompt tokens ahead
    assert meter.predict_ttft(1000) == pytest.approx(2.0)
    meter.abandoned(3000)  # they left before their first token
    assert meter.pending == 0 and meter.predict_ttft(1000) == pytest.approx(0.5)


def test_the_rate_follows_a_slower_pool() -> None:
    clock = Clock()
    meter = PrefillMeter(clock)
    for _ in range(5):
        served(meter, clock, 1000, 0.5)
    for _ in range(30):
        served(meter, clock, 1000, 2.0)  # e.g. a worker gone: four times slower
    assert meter.rate() == pytest.approx(500.0, rel=0.05)


def test_admission_refuses_what_would_miss_the_slo_with_a_retry_hint() -> None:
    clock = Clock()
    meter = PrefillMeter(clock)
    for _ in range(3):
        served(meter, clock, 1000, 0.5)
    gate = TtftAdmission(slo_s=1.0)
    gate.check(meter, 1000)  # 0.5 s predicted: admitted (no exception)
    meter.start(2000)  # now 1 s of work ahead
    with pytest.raises(Overloaded) as e:
        gate.check(meter, 1000)  # 1.5 s predicted
    err = e.value
    outcome = outcome_of(err)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and outcome.http_status == 429
    assert outcome.label == "rejected"
    assert err.retry_after_s == pytest.approx(0.5)
    assert api_error(outcome).headers == {"Retry-After": "1"}
    assert grpc_trailers(outcome) == (("grpc-retry-pushback-ms", "500"),)
    assert "predicted time to first token 1.50 s exceeds the SLO of 1 s" in str(err)


def test_a_cold_router_admits_everything() -> None:
    TtftAdmission(slo_s=0.001).check(PrefillMeter(), 100_000)  # no exception


@pytest.mark.parametrize("slo", [0.0, -1.0, float("nan")])
def test_the_slo_must_be_positive(slo: float) -> None:
    with pytest.raises(ValueError):
        TtftAdmission(slo_s=slo)


def decoding(meter: DecodeMeter) -> tuple[float, float]:
    """A request admitted and now past its first token; its mark."""
    meter.joined()
    return meter.first_token()


def streamed(meter: DecodeMeter, clock: Clock, tokens: int, tpot_s: float,
             beside: int = 0) -> None:
    """One request decoding `tokens` at `tpot_s` with `beside` other streams decoding all along."""
    others = [decoding(meter) for _ in range(beside)]
    mark = decoding(meter)
    clock.t += tpot_s * (tokens - 1)
    meter.finished(mark, tokens)
    for o in others:
        meter.left(o)


def test_the_decode_meter_predicts_nothing_until_it_has_seen_a_few_streams() -> None:
    clock = Clock()
    meter = DecodeMeter(clock)
    for _ in range(2):
        streamed(meter, clock, 11, 0.010)
        assert meter.predict_tpot() is None
    streamed(meter, clock, 11, 0.010)
    assert meter.predict_tpot() == pytest.approx(0.010)  # one batch size seen: its mean
    assert (meter.decoding, meter.joining) == (0, 0)


def test_tpot_is_read_off_the_line_at_the_streams_a_request_would_join() -> None:
    clock = Clock()
    meter = DecodeMeter(clock)
    for _ in range(4):  # alone: 10 ms a token; beside three others: 25 ms (5 ms per stream)
        streamed(meter, clock, 11, 0.010)
        streamed(meter, clock, 11, 0.025, beside=3)
    assert meter.predict_tpot() == pytest.approx(0.010)  # nothing else decoding now
    running = [decoding(meter) for _ in range(5)]
    assert meter.predict_tpot() == pytest.approx(0.035)  # 6 streams once this one joins
    meter.joined()  # admitted, still prefilling: it will decode beside them too
    assert meter.predict_tpot() == pytest.approx(0.040)
    meter.left(None)
    for r in running:
        meter.left(r)
    assert (meter.decoding, meter.joining) == (0, 0)


def test_one_token_and_abandoned_streams_teach_nothing() -> None:
    clock = Clock()
    meter = DecodeMeter(clock)
    for _ in range(5):
        mark = decoding(meter)
        clock.t += 1.0
        meter.finished(mark, 1)  # a single token: no time per output token
        meter.joined()
        meter.left(None)  # refused or cancelled before its first token
    assert meter.predict_tpot() is None and (meter.decoding, meter.joining) == (0, 0)


def test_tpot_admission_refuses_with_a_retry_hint() -> None:
    clock = Clock()
    meter = DecodeMeter(clock)
    for _ in range(3):
        streamed(meter, clock, 101, 0.020)  # 2 s of decode each
    gate = TpotAdmission(slo_s=0.025)
    gate.check(meter)  # 20 ms predicted: admitted
    TpotAdmission(slo_s=0.001).check(DecodeMeter(clock))  # a cold router admits everything
    running = [decoding(meter) for _ in range(4)]
    with pytest.raises(Overloaded) as e:
        TpotAdmission(slo_s=0.015).check(meter)
    err = e.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and outcome_of(err).label == "rejected"
    assert "predicted time per output token 20.0 ms exceeds the SLO of 15 ms" in str(err)
    assert "4 streams decoding" in str(err)
    assert err.retry_after_s == pytest.approx(0.5)  # a 2 s decode, one of four places frees
    for r in running:
        meter.left(r)


@pytest.mark.parametrize("slo", [0.0, -1.0])
def test_the_tpot_slo_must_be_positive(slo: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        TpotAdmission(slo_s=slo)
