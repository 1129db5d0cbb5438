"""Arrival processes: mean rate, dispersion (CV of gaps), determinism and input checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.arrivals import arrival_times

N = 20_000


def _rate_and_cv(times: list[float]) -> tuple[float, float]:
    gaps = np.diff(times)
    return (len(times) - 1) / times[-1], float(np.std(gaps) / np.mean(gaps))


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_poisson_rate_and_cv(seed: int) -> None:
    t = arrival_times(N, rate=5.0, seed=seed)
    rate, cv = _rate_and_cv(t)
    assert rate == pytest.approx(5.0, rel=0.03)
    assert cv == pytest.approx(1.0, rel=0.04)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
@pytest.mark.parametrize("seed", [0, 3])
def test_gamma_rate_and_cv(burstiness: float, seed: int) -> None:
    t = arrival_times(N, rate=20.0, kind="gamma", burstiness=burstiness, seed=seed)
    rate, cv = _rate_and_cv(t)
    assert rate == pytest.approx(20.0, rel=0.05)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.07)


def test_gamma_burstiness_one_is_poisson_like() -> None:
    rate, cv = _rate_and_cv(arrival_times(N, rate=2.0, kind="gamma", burstiness=1.0, seed=5))
    assert rate == pytest.approx(2.0, rel=0.03) and cv == pytest.approx(1.0, rel=0.04)


def test_constant_is_exact() -> None:
    t = arrival_times(5, rate=4.0, kind="constant")
    assert t == [0.0, 0.25, 0.5, 0.75, 1.0]
    rate, cv = _rate_and_cv(arrival_times(N, rate=3.0, kind="constant"))
    assert rate == pytest.approx(3.0, rel=1e-9) and cv == pytest.approx(0.0, abs=1e-6)


def test_first_arrival_is_zero_and_edge_cases() -> None:
    assert arrival_times(0, 1.0) == []
    assert arrival_times(1, 1.0) == [0.0]
    assert arrival_times(3, 1.0, seed=9)[0] == 0.0
    assert arrival_times(4, math.inf) == [0.0] * 4
    assert arrival_times(4, math.inf, kind="gamma", burstiness=0.5) == [0.0] * 4


def test_deterministic_per_seed() -> None:
    for kind, b in (("poisson", 1.0), ("gamma", 0.5)):
        a = arrival_times(100, 3.0, kind, b, seed=42)
        assert a == arrival_times(100, 3.0, kind, b, seed=42)
        assert a != arrival_times(100, 3.0, kind, b, seed=43)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": -1, "rate": 1.0},
        {"n": 2.5, "rate": 1.0},
        {"n": 3, "rate": 0.0},
        {"n": 3, "rate": -2.0},
        {"n": 3, "rate": math.nan},
        {"n": 3, "rate": 1.0, "kind": "uniform"},
        {"n": 3, "rate": 1.0, "kind": "gamma", "burstiness": 0.0},
        {"n": 3, "rate": 1.0, "kind": "gamma", "burstiness": math.inf},
        {"n": 3, "rate": 1.0, "kind": "poisson", "burstiness": 2.0},
    ],
)
def test_bad_input(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        arrival_times(**kwargs)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(0, 200),
    rate=st.floats(1e-3, 1e4),
    kind=st.sampled_from(["poisson", "gamma", "constant"]),
    burstiness=st.floats(0.05, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_nondecreasing_and_sized(n: int, rate: float, kind: str, burstiness: float,
                                 seed: int) -> None:
    b = burstiness if kind == "gamma" else 1.0
    t = arrival_times(n, rate, kind, b, seed)
    assert len(t) == n
    assert all(isinstance(x, float) and math.isfinite(x) for x in t)
    assert all(x <= y for x, y in zip(t, t[1:]))
    if n:
        assert t[0] == 0.0
