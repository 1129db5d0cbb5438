"""SLO-driven autoscaling of a Ray deployment: each pool grows and shrinks on its own signal.

Lifecycle of one tick (every `interval_s`, a thread of the controller):
  scrape   the router's /metrics (TTFT and TPOT histograms, requests, queue) and each worker's
           (queue length, KV cache usage) → a `Sample`;
  window   the difference between now and the sample `window_s` ago → `Signals` (p90 TTFT and
           TPOT of the requests in the window, arrival rate, queue and KV usage per pool);
  decide   `decide()` — a pure function, unit-tested on synthetic signals — gives each pool its
           next size: grow when its SLO is missed (prefill: TTFT, or a queue behind; decode:
           TPOT, or the KV cache full), shrink one at a time when comfortably inside it, and
           never below what the planner's model (splitserve/planner.py, from `splitserve plan`'s
           measured profile) says the observed rate needs; within bounds, one change per pool
           per `cooldown_s`;
  act      `controller.scale(...)`, which starts new workers before it drains old ones.
Why per pool: prefill capacity sets TTFT, decode capacity TPOT; a rate step moves both, a
long-prompt mix mostly the first. The prefill signal is TTFT minus nothing: queueing at the
router shows there first.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import ray
from prometheus_client.parser import text_string_to_metric_families

from deploy.ray.config import AutoscaleConfig
from splitserve import scrape
from splitserve.roles import Role

log = logging.getLogger(__name__)
ROUTER = "splitserve:"


@dataclass(frozen=True)
class Sample:
    """Cumulative counters at one time (histogram buckets as {le: count})."""

    t: float
    requests: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft: dict[float, float] = field(default_factory=dict)
    tpot: dict[float, float] = field(default_factory=dict)
    waiting: float = 0.0  # router: requests waiting for an admission slot
    queue: dict[str, float] = field(default_factory=dict)  # per pool: sum of workers' queues
    kv_usage: dict[str, float] = field(default_factory=dict)  # per pool: the fullest worker


@dataclass(frozen=True)
class Signals:
    """What one window shows; None where it holds no request."""

    rate: float  # requests per second finished in the window
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    waiting: float
    prefill_queue: float
    decode_kv_usage: float
    mean_prompt: float = 0.0
    mean_output: float = 0.0


def parse_router(text: str, t: float) -> Sample:
    """The router's Prometheus text → a Sample (counters summed over labels)."""
    vals: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {"ttft": {}, "tpot": {}}
    hist = {ROUTER + "time_to_first_token_seconds": "ttft",
            ROUTER + "time_per_output_token_seconds": "tpot"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") and s.name[:-7] in hist:
                b = buckets[hist[s.name[:-7]]]
                le = float(s.labels["le"])
                b[le] = b.get(le, 0.0) + s.value
            elif s.name.startswith(ROUTER):
                vals[s.name] = vals.get(s.name, 0.0) + s.value
    return Sample(t, vals.get(ROUTER + "requests_total", 0.0),
                  vals.get(ROUTER + "prompt_tokens_total", 0.0),
                  vals.get(ROUTER + "generation_tokens_total", 0.0), buckets["ttft"],
                  buckets["tpot"], vals.get(ROUTER + "num_requests_waiting", 0.0))


def parse_worker(text: str) -> tuple[float, float]:
    """A worker's (queue length, KV cache usage in [0, 1])."""
    queue = usage = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == ROUTER + "worker_queue_len":
                queue += s.value
            elif s.name == ROUTER + "kv_cache_usage_perc":
                usage = max(usage, s.value)
    return queue, usage


def quantile(q: float, now: dict[float, float], then: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over the bucket increase between two samples."""
    inc = sorted((le, now[le] - then.get(le, 0.0)) for le in now)
    total = inc[-1][1] if inc else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, count in inc:
        if count >= rank:
            if math.isinf(le):
                return lo  # past the last finite bucket: its bound is what is known
            return lo + (le - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = le, count
    return lo


def signals(now: Sample, then: Sample) -> Signals:
    dt = max(now.t - then.t, 1e-9)
    n = now.requests - then.requests
    return Signals(rate=n / dt, ttft_p90_s=quantile(0.9, now.ttft, then.ttft),
                   tpot_p90_s=quantile(0.9, now.tpot, then.tpot), waiting=now.waiting,
                   prefill_queue=now.queue.get(Role.PREFILL.value, 0.0),
                   decode_kv_usage=now.kv_usage.get(Role.DECODE.value, 0.0),
                   mean_prompt=(now.prompt_tokens - then.prompt_tokens) / n if n > 0 else 0.0,
                   mean_output=(now.output_tokens - then.output_tokens) / n if n > 0 else 0.0)


def plan_sizes(profile, cfg: AutoscaleConfig, s: Signals) -> tuple[int, int] | None:
    """The planner's fewest workers for the observed rate and lengths (None: no rate yet)."""
    if profile is None or s.rate <= 0 or s.mean_output < 1:
        return None
    from splitserve.planner import cheapest, simulate
    from splitserve.slo import SLO

    slo = SLO(ttft_s=cfg.ttft_slo_s, tpot_s=cfg.tpot_slo_s)
    work = [(max(int(s.mean_prompt), 1), max(int(s.mean_output), 1))]
    rows = [simulate(profile, p, d, s.rate, work, slo, num_requests=500)
            for p in range(max(cfg.min_prefill, 1), cfg.max_prefill + 1)
            for d in range(cfg.min_decode, cfg.max_decode + 1)]
    best = cheapest(rows)
    return (best.num_prefill, best.num_decode) if best else (cfg.max_prefill, cfg.max_decode)


def _next(current: int, behind: bool, idle: bool, floor: int, lo: int, hi: int) -> int:
    if behind:
        want = max(current + 1, floor)
    elif floor > current:
        want = floor  # the planner sees more load coming than this size serves
    elif idle:
        want = max(current - 1, floor)  # one at a time: shrinking is the risky direction
    else:
        want = current
    return min(max(want, lo), hi)


def decide(cfg: AutoscaleConfig, current: dict[str, int], s: Signals,
           plan: tuple[int, int] | None = None, now: float = 0.0,
           last_change: dict[str, float] | None = None) -> tuple[dict[str, int], list[str]]:
    """Each pool's next size and why; a pool changed less than `cooldown_s` ago stays."""
    last_change = last_change or {}
    ratio = cfg.scale_down_ratio
    p, d = current[Role.PREFILL.value], current[Role.DECODE.value]
    ttft, tpot = s.ttft_p90_s, s.tpot_p90_s
    p_behind = ((ttft is not None and ttft > cfg.ttft_slo_s)
                or s.prefill_queue + s.waiting > cfg.queue_per_worker * max(p, 1))
    p_idle = (ttft is None or ttft < ratio * cfg.ttft_slo_s) and s.prefill_queue + s.waiting == 0
    d_behind = (tpot is not None and tpot > cfg.tpot_slo_s) or s.decode_kv_usage > cfg.kv_high
    d_idle = (tpot is None or tpot < ratio * cfg.tpot_slo_s) and s.decode_kv_usage < cfg.kv_high / 2
    if s.rate == 0 and s.waiting > 0:  # nothing finishes but work waits: behind, not idle
        p_idle = d_idle = False
    floor_p, floor_d = plan if plan is not None else (0, 0)
    out = {Role.PREFILL.value: _next(p, p_behind, p_idle, floor_p, cfg.min_prefill,
                                     cfg.max_prefill),
           Role.DECODE.value: _next(d, d_behind, d_idle, floor_d, cfg.min_decode, cfg.max_decode)}
    why = []
    for pool, behind, sig, slo in ((Role.PREFILL.value, p_behind, ttft, cfg.ttft_slo_s),
                                   (Role.DECODE.value, d_behind, tpot, cfg.tpot_slo_s)):
        if out[pool] != current[pool] and now - last_change.get(pool, -math.inf) < cfg.cooldown_s:
            out[pool] = current[pool]  # cooling down from its last change
        elif out[pool] != current[pool]:
            p90 = "none" if sig is None else f"{sig * 1e3:.0f} ms"
            why.append(f"{pool} {current[pool]}->{out[pool]}: p90 {p90} vs SLO "
                       f"{slo * 1e3:.0f} ms, {'behind' if behind else 'within'}, "
                       f"rate {s.rate:.2f}/s" + (f", plan {plan}" if plan else ""))
    return out, why


class Autoscaler:
    """The controller's thread that scrapes, decides and scales (see the module docstring)."""

    def __init__(self, controller, cfg: AutoscaleConfig) -> None:
        self.controller, self.cfg = controller, cfg
        self.profile = None
        if cfg.profile is not None:
            from splitserve.planner import Profile

            self.profile = Profile.from_dict(cfg.profile)
        self.samples: deque[Sample] = deque()
        self.last_change: dict[str, float] = {}
        self.ticks = 0  # ticks that read the metrics (for `status`)
        self.last: Signals | None = None  # what the last full window showed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-autoscale",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.cfg.interval_s + 5)

    def sample(self) -> Sample:
        c = self.controller
        s = parse_router(scrape.fetch(c.endpoints["http"] + "/metrics", 5),
                         time.monotonic())
        for role, slots in list(c.pools.items()):
            queue, usage = 0.0, 0.0
            for slot in list(slots):
                try:  # asked each time: a restarted worker has a new metrics port
                    info = ray.get(slot.actor.info.remote(), timeout=5)
                    q, u = parse_worker(scrape.fetch(info["endpoints"]["metrics"], 5))
                except (OSError, KeyError, ValueError, ray.exceptions.RayError,
                        ray.exceptions.GetTimeoutError):
                    continue  # starting or restarting: its next scrape will count
                queue, usage = queue + q, max(usage, u)
            s.queue[role.value], s.kv_usage[role.value] = queue, usage
        return s

    def tick(self) -> None:
        now = self.sample()
        self.ticks += 1
        if self.samples and now.requests < self.samples[-1].requests:
            # The router restarted: its counters began again from zero. A window across that
            # would read as a negative rate and no latencies -- idle, while requests may be
            # missing the SLO. The window starts over instead.
            self.samples.clear()
        self.samples.append(now)
        while len(self.samples) > 1 and now.t - self.samples[1].t >= self.cfg.window_s:
            self.samples.popleft()
        if len(self.samples) < 2:
            return
        sig = signals(now, self.samples[0])
        self.last = sig
        sizes = self.controller.sizes()
        want, why = decide(self.cfg, sizes, sig, plan_sizes(self.profile, self.cfg, sig),
                           now.t, self.last_change)
        if want != sizes:
            for pool in want:
                if want[pool] != sizes[pool]:
                    self.last_change[pool] = now.t
            self.controller.scale(want[Role.PREFILL.value], want[Role.DECODE.value],
                                  reason="autoscale: " + "; ".join(why))

    def report(self) -> dict:
        """For `splitserve ray status`: how often it looked, and what it last saw."""
        return {"ticks": self.ticks, "interval_s": self.cfg.interval_s,
                "signals": None if self.last is None else asdict(self.last)}

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self.tick()
            except Exception as e:  # a failed tick (router restarting) must not end scaling
                log.warning("autoscale tick failed: %s", e)
