"""The autoscaler's decisions on synthetic metrics: parsing the router's Prometheus text, window
percentiles, each pool on its own signal, bounds, cooldown, one step down, the planner's floor."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench.planner import Profile
from deploy.ray.autoscale import Signals, decide, parse_router, parse_worker, plan_sizes, quantile
from deploy.ray.config import AutoscaleConfig
from router.metrics import RouterMetrics

CFG = AutoscaleConfig(min_prefill=1, max_prefill=3, min_decode=1, max_decode=3, ttft_slo_s=0.5,
                      tpot_slo_s=0.05, cooldown_s=30)
NOW = {"prefill": 1, "decode": 1}


def _signals(**kw) -> Signals:
    base = dict(rate=1.0, ttft_p90_s=0.1, tpot_p90_s=0.01, waiting=0.0, prefill_queue=0.0,
                decode_kv_usage=0.1, mean_prompt=100, mean_output=50)
    return Signals(**{**base, **kw})


def test_router_metrics_parse_into_window_percentiles() -> None:
    # The router's own metric objects, observed and rendered as its /metrics serves them.
    reg = CollectorRegistry()
    m = RouterMetrics(reg, "tiny")
    first = parse_router(generate_latest(reg).decode(), t=0.0)
    for s in [0.05] * 80 + [0.9] * 20:  # p90 falls in the 0.9 s observations' bucket
        m.ttft.labels("tiny").observe(s)
    for s in [0.01] * 100:
        m.tpot.labels("tiny").observe(s)
    second = parse_router(generate_latest(reg).decode(), t=10.0)
    p90 = quantile(0.9, second.ttft, first.ttft)
    assert 0.5 < p90 <= 1.0
    assert quantile(0.9, second.tpot, first.tpot) <= 0.025
    assert quantile(0.9, first.ttft, first.ttft) is None  # no request in the window


def test_worker_metrics_give_queue_and_kv_usage() -> None:
    text = ('# TYPE splitserve:worker_queue_len gauge\nsplitserve:worker_queue_len{role="prefill"}'
            ' 3.0\n# TYPE splitserve:kv_cache_usage_perc gauge\n'
            'splitserve:kv_cache_usage_perc{role="prefill"} 0.4\n')
    assert parse_worker(text) == (3.0, 0.4)


def test_pools_move_on_their_own_signal() -> None:
    want, why = decide(CFG, NOW, _signals(ttft_p90_s=0.8))  # TTFT missed: prefill only
    assert want == {"prefill": 2, "decode": 1} and "prefill 1->2" in why[0]
    want, _ = decide(CFG, NOW, _signals(tpot_p90_s=0.08))  # TPOT missed: decode only
    assert want == {"prefill": 1, "decode": 2}
    want, _ = decide(CFG, NOW, _signals(decode_kv_usage=0.95))  # KV cache full: decode
    assert want == {"prefill": 1, "decode": 2}
    want, _ = decide(CFG, NOW, _signals(prefill_queue=9.0))  # a queue behind prefill
    assert want == {"prefill": 2, "decode": 1}


def test_within_the_slo_nothing_moves_and_bounds_hold() -> None:
    assert decide(CFG, NOW, _signals(ttft_p90_s=0.4, tpot_p90_s=0.04))[0] == NOW
    at_max = {"prefill": 3, "decode": 3}
    assert decide(CFG, at_max, _signals(ttft_p90_s=5, tpot_p90_s=5))[0] == at_max
    assert decide(CFG, NOW, _signals(rate=0.0, ttft_p90_s=None, tpot_p90_s=None))[0] == NOW


def test_shrinks_one_at_a_time_when_comfortably_inside() -> None:
    big = {"prefill": 3, "decode": 3}
    want, _ = decide(CFG, big, _signals(rate=0.0, ttft_p90_s=None, tpot_p90_s=None))
    assert want == {"prefill": 2, "decode": 2}
    # Inside the SLO but above half of it: hold, do not shrink into a miss.
    assert decide(CFG, big, _signals(ttft_p90_s=0.3, tpot_p90_s=0.03))[0] == big


def test_cooldown_holds_a_pool_that_just_changed() -> None:
    s = _signals(ttft_p90_s=0.8, tpot_p90_s=0.08)
    want, _ = decide(CFG, NOW, s, now=100.0, last_change={"prefill": 90.0})
    assert want == {"prefill": 1, "decode": 2}  # prefill cooling down, decode free to move
    want, _ = decide(CFG, NOW, s, now=121.0, last_change={"prefill": 90.0})
    assert want == {"prefill": 2, "decode": 2}


def test_planner_floor_grows_ahead_and_stops_the_shrink() -> None:
    idle = _signals(ttft_p90_s=0.01, tpot_p90_s=0.001, decode_kv_usage=0.0)
    assert decide(CFG, NOW, idle, plan=(2, 3))[0] == {"prefill": 2, "decode": 3}
    big = {"prefill": 3, "decode": 3}
    assert decide(CFG, big, idle, plan=(3, 2))[0] == {"prefill": 3, "decode": 2}


def test_plan_sizes_come_from_the_planner_model() -> None:
    # One worker does a 100-token prefill in 0.1 s and a decode step in 10 ms (+1 ms a seq).
    prof = Profile(prefill_base_s=0.0, prefill_per_token_s=1e-3, decode_base_s=0.01,
                   decode_per_seq_s=0.001, overhead_s=0.0)
    low = plan_sizes(prof, CFG, _signals(rate=0.5))
    high = plan_sizes(prof, CFG, _signals(rate=12.0))
    assert low == (1, 1)
    assert high[0] > 1  # 12 req/s x 0.1 s of prefill each is more than one worker's second
    assert plan_sizes(None, CFG, _signals()) is None


def test_config_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="min_decode"):
        AutoscaleConfig(min_decode=0)
    with pytest.raises(ValueError, match="max_prefill"):
        AutoscaleConfig(min_prefill=3, max_prefill=2)
