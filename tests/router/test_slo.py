"""SLO-aware admission's arithmetic on a hand-driven clock (end to end: tests/e2e/test_slo.py)."""

from __future__ import annotations

import grpc
import pytest

from router.slo import Overloaded, PrefillMeter, TtftAdmission


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
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.http_status == 429
    assert err.outcome == "rejected"
    assert err.retry_after_s == pytest.approx(0.5)
    assert err.http_headers() == {"Retry-After": "1"}
    assert err.grpc_trailers() == (("grpc-retry-pushback-ms", "500"),)
    assert "predicted time to first token 1.50 s exceeds the SLO of 1 s" in str(err)


def test_a_cold_router_admits_everything() -> None:
    TtftAdmission(slo_s=0.001).check(PrefillMeter(), 100_000)  # no exception


@pytest.mark.parametrize("slo", [0.0, -1.0, float("nan")])
def test_the_slo_must_be_positive(slo: float) -> None:
    with pytest.raises(ValueError):
        TtftAdmission(slo_s=slo)
