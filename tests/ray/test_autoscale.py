"""The autoscaler's decisions on synthetic metrics: parsing the router's Prometheus text, window
percentiles, each pool on its own signal, bounds, cooldown, one step down, the planner's floor.

Then its sampling path on recorded signal sequences: a fake controller replays /metrics pages
rendered by the router's own metric objects (and workers' pages in their format), one frame a
tick, with the module's clock, scraper and `ray.get` replaced, so `sample()`, `tick()` and the
thread's loop run as deployed, without a cluster, a sleep or a thread."""

from __future__ import annotations

import dataclasses
import logging
import urllib.error
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from deploy.ray import autoscale
from deploy.ray.autoscale import (
    Autoscaler,
    Signals,
    decide,
    parse_router,
    parse_worker,
    plan_sizes,
    quantile,
    signals,
)
from deploy.ray.config import AutoscaleConfig
from router.metrics import RouterMetrics
from splitserve.planner import Profile
from splitserve.roles import Role

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


# -- the sampling path on recorded signal sequences ------------------------------------------------

ROUTER_URL = "http://router:8000"
# interval_s 0: the thread's loop (`_run`) runs its ticks back to back, in the test's own thread.
TICKS = dataclasses.replace(CFG, interval_s=0.0, window_s=30.0)


class _Router:
    """The router's /metrics: its own metric objects, moved as `RequestTrace.finish` moves them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.m = RouterMetrics(self.registry, "tiny")

    def finish(self, n: int, ttft: float, tpot: float = 0.03, prompt: int = 100,
               output: int = 50) -> None:
        for _ in range(n):
            self.m.outcome_m["finished"].inc()
            self.m.ttft_m.observe(ttft)
            self.m.tpot_m.observe(tpot)
            self.m.prompt_tokens_m.inc(prompt)
            self.m.generation_tokens_m.inc(output)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def _worker_text(role: str, queue: float, kv: float) -> str:
    """A worker's /metrics page: the gauges of splitserve/worker/metrics.py, its names and labels
    (that module is not imported: it loads vLLM)."""

    class Collector:
        def collect(self):
            for name, v in (("splitserve:worker_queue_len", queue),
                            ("splitserve:kv_cache_usage_perc", kv)):
                g = GaugeMetricFamily(name, "", labels=["model_name", "role", "worker"])
                g.add_metric(["tiny", role, f"{role}-0"], v)
                yield g

    reg = CollectorRegistry()
    reg.register(Collector())
    return generate_latest(reg).decode()


@dataclass(frozen=True)
class _Frame:
    """One scrape: the clock, the router's page (an exception: the router is down), and the pages
    of workers by metrics URL (a worker not named serves an idle page)."""

    t: float
    router: str | Exception
    workers: dict[str, str] = field(default_factory=dict)


def _slot(answer: dict | Exception) -> SimpleNamespace:
    """A controller Slot whose actor's info() answers `answer` (an exception: raised by ray.get)."""
    return SimpleNamespace(actor=SimpleNamespace(info=SimpleNamespace(remote=lambda: answer)))


def _url(role: str, i: int) -> str:
    return f"http://{role}-{i}:9000/metrics"


class _Controller:
    """What `Autoscaler` uses of deploy/ray/controller.py's Controller (`endpoints`, `pools`,
    `sizes()`, `scale()`), replaying frames: each scrape of the router's page takes the next."""

    def __init__(self, frames: list[_Frame], prefill: int = 1, decode: int = 1) -> None:
        self.frames, self.next = list(frames), 0
        self.frame = self.frames[0]
        self.endpoints = {"http": ROUTER_URL}
        self.pools: dict[Role, list[SimpleNamespace]] = {}
        self.scaled: list[tuple[float, int, int]] = []  # (clock, prefill, decode) asked
        self.reasons: list[str] = []
        self.fail_scale_at: set[float] = set()  # clocks at which scale() fails as Ray's would
        self.on_last = lambda: None  # called when the last frame is taken
        self._resize(prefill, decode)

    def _resize(self, prefill: int, decode: int) -> None:
        self.pools = {r: [_slot({"endpoints": {"metrics": _url(r.value, i)}}) for i in range(n)]
                      for r, n in ((Role.PREFILL, prefill), (Role.DECODE, decode))}

    def sizes(self) -> dict[str, int]:
        return {r.value: len(slots) for r, slots in self.pools.items()}

    def scale(self, prefill: int, decode: int, reason: str) -> dict:
        self.scaled.append((self.frame.t, prefill, decode))
        self.reasons.append(reason)
        if self.frame.t in self.fail_scale_at:
            raise RuntimeError("the Ray cluster cannot place 1 more prefill worker(s)")
        self._resize(prefill, decode)
        return {}

    def fetch(self, url: str, timeout_s: float) -> str:
        if url == ROUTER_URL + "/metrics":
            if self.next == len(self.frames):
                pytest.fail("the autoscaler scraped past the end of the recording")
            self.frame = self.frames[self.next]
            self.next += 1
            if self.next == len(self.frames):
                self.on_last()
            page = self.frame.router
        else:
            page = self.frame.workers.get(url, _worker_text("idle", 0.0, 0.1))
        if isinstance(page, Exception):
            raise page
        return page


def _ray_get(ref: dict | Exception, timeout: float) -> dict:
    if isinstance(ref, Exception):
        raise ref
    return ref


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch):
    """Installs a _Controller as what the module scrapes, asks (`ray.get`) and times (its
    monotonic clock is the frame's); returns (controller, its Autoscaler)."""

    def install(ctl: _Controller, cfg: AutoscaleConfig = TICKS) -> tuple[_Controller, Autoscaler]:
        monkeypatch.setattr(autoscale, "scrape", SimpleNamespace(fetch=ctl.fetch))
        monkeypatch.setattr(autoscale, "time", SimpleNamespace(monotonic=lambda: ctl.frame.t))
        monkeypatch.setattr(autoscale, "ray", SimpleNamespace(get=_ray_get,
                                                              exceptions=ray.exceptions))
        return ctl, Autoscaler(ctl, cfg)

    return install


def test_signals_of_a_window_are_the_counters_differences() -> None:
    r = _Router()
    # Before the window: slow, long requests that must not count in it.
    r.finish(20, ttft=2.0, tpot=0.2, prompt=1000, output=10)
    then = parse_router(r.text(), t=100.0)
    r.finish(5, ttft=0.45, tpot=0.012, prompt=100, output=40)
    r.finish(5, ttft=0.45, tpot=0.012, prompt=300, output=60)
    r.m.waiting_m.set(3)
    now = dataclasses.replace(parse_router(r.text(), t=120.0),
                              queue={"prefill": 5.0, "decode": 1.0},
                              kv_usage={"prefill": 0.3, "decode": 0.9})
    s = signals(now, then)
    assert s.rate == pytest.approx(10 / 20)  # 10 requests in 20 s
    # Every window TTFT is in the (0.4, 0.5] bucket: p90 interpolates to 0.4 + 0.1 * 9/10.
    assert s.ttft_p90_s == pytest.approx(0.49)
    assert s.tpot_p90_s == pytest.approx(0.01 + 0.005 * 0.9)  # (0.01, 0.015] bucket
    assert s.mean_prompt == pytest.approx(200) and s.mean_output == pytest.approx(50)
    # Gauges are read at the window's end, per pool: the prefill queue, the decode KV usage.
    assert (s.waiting, s.prefill_queue, s.decode_kv_usage) == (3.0, 5.0, 0.9)
    empty = signals(then, dataclasses.replace(then, t=90.0))  # no request in the window
    assert (empty.rate, empty.ttft_p90_s, empty.tpot_p90_s, empty.mean_prompt) == (0, None,
                                                                                   None, 0)


def test_sample_reads_the_router_and_every_reachable_worker(replay) -> None:
    r = _Router()
    r.finish(7, ttft=0.3, prompt=120, output=30)
    r.m.waiting_m.set(2)
    workers = {_url("prefill", 0): _worker_text("prefill", 3, 0.2),
               _url("prefill", 1): _worker_text("prefill", 2, 0.3),
               _url("decode", 0): _worker_text("decode", 1, 0.5),
               _url("decode", 1): _worker_text("decode", 0, 0.9)}
    ctl, a = replay(_Controller([_Frame(42.0, r.text(), workers)], prefill=2, decode=2))
    # Workers that cannot answer this time are skipped, not counted as empty or failing the
    # sample: a busy actor (timeout), a restarting one, one still starting (no endpoints yet),
    # one whose metrics port is not up.
    ctl.pools[Role.PREFILL] += [_slot(ray.exceptions.GetTimeoutError("busy")),
                                _slot({"endpoints": {}})]
    ctl.pools[Role.DECODE] += [_slot(ray.exceptions.RayActorError()),
                               _slot({"endpoints": {"metrics": "http://down:9000/metrics"}})]
    workers["http://down:9000/metrics"] = urllib.error.URLError("connection refused")
    s = a.sample()
    assert s.t == 42.0  # the module's monotonic clock
    assert (s.requests, s.prompt_tokens, s.output_tokens, s.waiting) == (7, 840, 210, 2)
    assert sum(s.ttft.values()) > 0 and s.ttft[float("inf")] == 7
    # A pool's queue is its workers' sum (work waiting anywhere in it), its KV usage the fullest
    # worker's (one full decode worker already stalls what it holds).
    assert s.queue == {"prefill": 5.0, "decode": 1.0}
    assert s.kv_usage == {"prefill": 0.3, "decode": 0.9}


def _load_then_idle() -> list[_Frame]:
    """Every 10 s: 10 requests within the TTFT SLO, then 60 s of requests missing it (TPOT in
    the hold band between half the SLO and the SLO throughout), then nothing at all."""
    r, frames = _Router(), []
    for t in range(0, 180, 10):
        if t == 10:
            r.finish(10, ttft=0.3)
        elif 20 <= t <= 80:
            r.finish(10, ttft=0.9)
        frames.append(_Frame(float(t), r.text()))
    return frames


def test_ticks_scale_up_on_a_missed_ttft_then_down_one_step_when_idle(replay) -> None:
    ctl, a = replay(_Controller(_load_then_idle(), prefill=1, decode=2))
    for _ in ctl.frames:
        a.tick()
    assert ctl.scaled == [
        # t=0: one sample, no window yet; t=10: p90 0.295 s, inside the SLO but above half.
        (20.0, 2, 2),  # the window's p90 is 0.87 s > 0.5 s: prefill grows, decode (TPOT) holds
        # t=30, 40: still missed, but prefill changed less than cooldown_s (30 s) ago.
        (50.0, 3, 2),
        # t=60, 70 cooling; t=80 onwards prefill is at max_prefill: no call while still missed;
        # t=90, 100: the 30 s window still holds the slow requests.
        (110.0, 2, 1),  # no request in the window, no queue: each pool one step down
        # t=120, 130 cooling.
        (140.0, 1, 1),  # decode is at min_decode and stays; t=150.. both at min: no call.
    ]
    assert ctl.reasons[0].startswith("autoscale: prefill 1->2: p90 870 ms vs SLO 500 ms, behind")
    assert "decode" not in ctl.reasons[0]
    assert ctl.sizes() == {"prefill": 1, "decode": 1}


def test_a_window_without_finished_requests_is_idle_unless_work_waits(replay) -> None:
    r = _Router()
    quiet = [_Frame(float(t), r.text()) for t in range(0, 100, 10)]
    ctl, a = replay(_Controller(quiet, prefill=1, decode=1))
    for _ in quiet:
        a.tick()
    assert ctl.scaled == []  # already at the minimum: an idle deployment is left alone
    # Nothing finishes, but 5 requests wait at the router (> queue_per_worker of one worker):
    # that is a stalled prefill pool, not an idle one.
    r.m.waiting_m.set(5)
    stalled = [_Frame(float(t), r.text()) for t in range(0, 30, 10)]
    ctl, a = replay(_Controller(stalled, prefill=1, decode=2))
    for _ in stalled:
        a.tick()
    assert ctl.scaled == [(10.0, 2, 2)]  # prefill grows; decode, not idle while work waits, holds


def test_the_loop_survives_a_failed_scrape_and_a_failed_scale(replay, caplog) -> None:
    r = _Router()
    frames = [_Frame(0.0, urllib.error.URLError("router restarting")), _Frame(0.0, r.text())]
    r.finish(10, ttft=0.9)
    frames.append(_Frame(10.0, r.text()))
    r.finish(10, ttft=0.9)
    frames.append(_Frame(50.0, r.text()))
    ctl, a = replay(_Controller(frames, prefill=1, decode=1))
    ctl.fail_scale_at = {10.0}
    ctl.on_last = a._stop.set  # the loop ends after the last frame's tick
    with caplog.at_level(logging.WARNING, logger=autoscale.__name__):
        a._run()  # the thread's body, here: interval_s 0, so no waiting
    assert ctl.next == len(frames)  # every tick ran, the ones after each failure too
    failed = [m.getMessage() for m in caplog.records]
    assert len(failed) == 2 and all(m.startswith("autoscale tick failed") for m in failed)
    assert "router restarting" in failed[0] and "cannot place" in failed[1]
    # The failed grow at t=10 was retried once cooldown_s had passed, and then took.
    assert ctl.scaled == [(10.0, 2, 1), (50.0, 2, 1)]
    assert ctl.sizes() == {"prefill": 2, "decode": 1}


def test_a_restarted_router_starts_the_window_over(replay) -> None:
    """Counters that went back (the router restarted) are not a window: without the restart
    rule, the difference read as rate -1.5/s and no p90, idle, and both pools stepped down
    while every new request missed the TTFT SLO."""
    before, after = _Router(), _Router()
    frames = []
    for t in (0.0, 10.0, 20.0):
        before.finish(10, ttft=0.3, tpot=0.03)  # inside the SLO, above half: hold
        frames.append(_Frame(t, before.text()))
    for t in (30.0, 40.0, 50.0):  # a new router process: its counters from zero
        after.finish(5, ttft=0.9, tpot=0.03)
        frames.append(_Frame(t, after.text()))
    ctl, a = replay(_Controller(frames, prefill=2, decode=2))
    for _ in frames:
        a.tick()
    assert [p for _, p, _ in ctl.scaled] and all(p >= 2 for _, p, _ in ctl.scaled), ctl.reasons
    assert ctl.scaled[0][0] == 40.0  # the first window after the restart: 30 s to 40 s


def test_ray_up_slo_is_read_in_seconds_with_its_units() -> None:
    """`ray up --autoscale --slo`: each target names its unit and reaches the config as seconds;
    a bare number (once milliseconds) is refused with the unit to write."""
    from deploy.cli import build_parser
    from deploy.ray.cli import _autoscale_of

    def cfg(*argv: str) -> AutoscaleConfig:
        return _autoscale_of(build_parser().parse_args(["ray", "up", "--autoscale", *argv]))

    got = cfg("--slo", "ttft=500ms,tpot=0.05s")
    assert (got.ttft_slo_s, got.tpot_slo_s) == (0.5, 0.05)
    default = cfg()
    assert (default.ttft_slo_s, default.tpot_slo_s) == (1.0, 0.1)
    with pytest.raises(ValueError, match="has no unit: write 1000ms or 1s"):
        cfg("--slo", "ttft=1000,tpot=100ms")
    with pytest.raises(ValueError, match="both ttft and tpot"):
        cfg("--slo", "ttft=1s")
