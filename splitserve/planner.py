"""DistServe-style capacity planning from measured load-test runs (`splitserve plan`, and the
Ray autoscaler's floor).

Lifecycle: bench result JSONs (runs[*].requests) → `load_rows` tags each request row with the
decode batch its run saw → `fit_profile` fits a linear per-worker `Profile` → `simulate` replays
Poisson arrivals through a discrete-event model of P prefill + D decode workers, or K colocated
ones → `recommend` runs every config up to `max_workers` → `cheapest` is the fewest workers that
reach the SLO attainment target. A plan is only as good as `assumptions()`: the CLI prints them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import median, quantiles
from typing import Any

_ARRIVE, _JOIN, _DONE = 0, 1, 2


@dataclass(frozen=True)
class Profile:
    """Service times of one worker, in seconds."""

    prefill_base_s: float
    prefill_per_token_s: float  # a prefill of P prompt tokens: base + per_token * P
    decode_base_s: float
    decode_per_seq_s: float  # a decode step over b running sequences: base + per_seq * b
    overhead_s: float  # once per request: router, network, KV transfer

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * prompt_tokens

    def step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        return cls(**{f.name: float(d[f.name]) for f in fields(cls)})


def _num(row: dict, key: str) -> bool:
    return isinstance(v := row.get(key), (int, float)) and math.isfinite(v)


def _nonneg_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares y = a + b*x, clipped to a, b >= 0: a negative time has no meaning."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if b < 0:  # noise, or a single x: the mean is the honest estimate
        return max(my, 0.0), 0.0
    return max(my - b * mx, 0.0), b


def fit_profile(rows: list[dict]) -> Profile:
    """A `Profile` from per-request rows (bench result `requests`; failed ones are skipped).
    prefill: least squares of prefill_s on prompt_tokens. decode: tpot_s is the mean step time a
    request saw; rows with a `batch` (sequences decoding per decode worker, see `load_rows`) fit
    tpot_s = base + per_seq * batch if >= 2 distinct batches exist, else per_seq = 0 and base =
    median tpot_s (valid near the measured load only). overhead: median(ttft - prefill - queue)."""
    ok = [r for r in rows if r.get("ok", True)]
    pre = [r for r in ok if _num(r, "prefill_s") and _num(r, "prompt_tokens")]
    dec = [r for r in ok if _num(r, "tpot_s") and (r.get("output_tokens") or 0) > 1]
    if not pre or not dec:
        raise ValueError("need successful request rows with prompt_tokens, prefill_s and tpot_s")
    pa, pb = _nonneg_line([r["prompt_tokens"] for r in pre], [r["prefill_s"] for r in pre])
    batched = [r for r in dec if _num(r, "batch")]
    if len({r["batch"] for r in batched}) >= 2:
        da, db = _nonneg_line([r["batch"] for r in batched], [r["tpot_s"] for r in batched])
    else:
        da, db = median(r["tpot_s"] for r in dec), 0.0
    over = [r["ttft_s"] - r["prefill_s"] - (r.get("queue_s") or 0.0)
            for r in pre if _num(r, "ttft_s")]
    return Profile(pa, pb, da, db, max(median(over), 0.0) if over else 0.0)


def load_rows(paths: list[str | Path]) -> list[dict]:
    """The request rows of all runs in bench result files, each tagged with its run's `batch` ≈
    Σ decode_s of ok requests / run duration / num_decode_workers: by Little's law the mean number
    of sequences decoding on one worker. Idle time pulls that below what a running step sees, so
    it is clipped at 1; a run without duration or num_decode_workers gets no batch."""
    rows: list[dict] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for run in data.get("runs") or [data]:
            reqs, dur = run.get("requests") or [], run.get("duration")
            nd = run.get("num_decode_workers") or data.get("num_decode_workers")
            busy = sum(r["decode_s"] for r in reqs if r.get("ok", True) and _num(r, "decode_s"))
            batch = max(busy / dur / nd, 1.0) if dur and nd else None
            rows.extend({"batch": batch, **r} for r in reqs)  # a row's own batch wins
    return rows


def load_profile_from_results(paths: list[str | Path]) -> Profile:
    return fit_profile(load_rows(paths))


@dataclass(frozen=True)
class Latency:
    """Mean and percentiles of one metric over the simulated requests, in ms."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        xs = [x * 1e3 for x in seconds if not math.isnan(x)]  # NaN: no TPOT (1-token output)
        q = (quantiles(xs if len(xs) > 1 else xs * 2, n=100, method="inclusive")  # = numpy's
             if xs else [math.nan] * 99)
        return cls(sum(xs) / len(xs) if xs else math.nan, q[49], q[89], q[98])


@dataclass(frozen=True)
class SimResult:
    """Predicted latencies of one config at one rate: P/D disaggregated, or K colocated."""

    num_prefill: int
    num_decode: int
    num_colocated: int
    rate: float
    attainment: float  # fraction of requests meeting every SLO target that is set
    goodput_rps: float  # rate * attainment: requests/s served within the SLOs
    ttft_ms: Latency
    tpot_ms: Latency
    e2el_ms: Latency

    @property
    def workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def label(self) -> str:
        k, p, d = self.num_colocated, self.num_prefill, self.num_decode
        return f"{k}x colocated" if k else f"{p}P{d}D"


class _Worker:
    def __init__(self, idx: int, prefill: bool, decode: bool) -> None:
        self.idx, self.prefill, self.decode = idx, prefill, decode
        self.queue: deque[int] = deque()  # own prefill queue (colocated only)
        self.running: list[tuple[int, int]] = []  # heap of (finish step, rid)
        self.pending: list[int] = []  # joined mid-step: admitted at the next step boundary
        self.op: tuple | None = None  # ("prefill", rid) | ("decode", t0, step_s, steps)
        self.steps = 0  # decode steps done: a sequence finishes at a known step count
        self.version = 0  # a bump voids the scheduled DONE of an op that was cut short

    def batch(self) -> int:
        return len(self.running) + len(self.pending)

    def load(self) -> int:  # colocated routing: queued + decoding + the prefill in progress
        return len(self.queue) + self.batch() + (self.op is not None and self.op[0] == "prefill")


def _run(p: Profile, ws: list[_Worker], colocated: bool,
         reqs: list[tuple[float, int, int]]) -> tuple[list[float], list[float]]:
    """The event loop: TTFT and TPOT per request (TPOT NaN for 1-token outputs). A decode op runs
    all steps up to the next finish as one event (the batch is constant in between), cut back to
    the next step boundary when work arrives: a few events per request, not one per token."""
    arrive, prompt, out = (list(x) for x in zip(*reqs))
    ttft, tpot, join = ([x] * len(reqs) for x in (0.0, math.nan, 0.0))
    shared: deque[int] = deque()  # disaggregated: one FCFS queue feeds every prefill worker
    ev = [(t, i, _ARRIVE, i, 0) for i, t in enumerate(arrive)]  # sorted, so already a heap
    seq = itertools.count(len(ev))

    def start(w: _Worker, t: float) -> None:
        for rid in w.pending:
            heapq.heappush(w.running, (w.steps + out[rid] - 1, rid))
        w.pending.clear()
        q = w.queue if colocated else shared
        if w.prefill and q:  # prefill first, as vLLM schedules: colocated, this is the stall
            rid = q.popleft()
            w.op, dt = ("prefill", rid), p.prefill_s(prompt[rid])
        elif w.running:
            s, k = p.step_s(len(w.running)), w.running[0][0] - w.steps
            w.op, dt = ("decode", t, s, k), k * s
        else:
            w.op = None
            return
        w.version += 1
        heapq.heappush(ev, (t + dt, next(seq), _DONE, w.idx, w.version))

    def kick(w: _Worker, t: float) -> None:
        """New work for w: start now if idle, else end its decode run at the next step boundary."""
        if w.op is None:
            start(w, t)
        elif w.op[0] == "decode":
            _, t0, s, k = w.op
            m = max(1, math.ceil((t - t0) / s - 1e-9)) if s > 0 else 1
            if m < k:
                w.op, w.version = ("decode", t0, s, m), w.version + 1
                heapq.heappush(ev, (t0 + m * s, next(seq), _DONE, w.idx, w.version))

    while ev:
        t, _, kind, a, b = heapq.heappop(ev)
        if kind == _ARRIVE and colocated:
            w = min(ws, key=_Worker.load)
            w.queue.append(a)
            kick(w, t)
        elif kind == _ARRIVE:  # the prefill worker that frees first takes the queue's head
            shared.append(a)
            idle = [w for w in ws if w.prefill and w.op is None]
            if idle:
                start(idle[0], t)
        elif kind == _JOIN:
            join[a], w = t, min((w for w in ws if w.decode), key=_Worker.batch)
            w.pending.append(a)
            kick(w, t)
        elif b == ws[a].version:  # else the op was cut short and rescheduled
            w = ws[a]
            op, w.op = w.op, None
            if op[0] == "decode":
                w.steps += op[3]
                while w.running and w.running[0][0] <= w.steps:
                    _, rid = heapq.heappop(w.running)
                    tpot[rid] = (t - join[rid]) / (out[rid] - 1)
            else:
                rid = op[1]
                ttft[rid] = t - arrive[rid] + p.overhead_s
                if out[rid] > 1 and colocated:  # the KV stays on this worker
                    join[rid] = t
                    w.pending.append(rid)
                elif out[rid] > 1:  # decoding starts once the KV has crossed (in the overhead)
                    heapq.heappush(ev, (t + p.overhead_s, next(seq), _JOIN, rid, 0))
            start(w, t)
    return ttft, tpot


def simulate(profile: Profile, num_prefill: int, num_decode: int, rate: float,
             workload: list[tuple[int, int]], slo: Any = None, seed: int = 0,
             num_requests: int = 2000, num_colocated: int = 0) -> SimResult:
    """Predict num_prefill P + num_decode D workers, or (P = D = 0) num_colocated K, at Poisson
    `rate` with (prompt, output) tokens drawn from `workload`; a seed gives every config the same
    requests. TPOT = (last token - decode join) / (output - 1): the mean step time seen, with the
    wait for the step in flight. `slo`: ttft_s / tpot_s / e2el_s, a splitserve.slo.SLO."""
    colocated = num_colocated > 0
    if (num_prefill or num_decode) if colocated else min(num_prefill, num_decode) < 1:
        raise ValueError("give num_prefill, num_decode >= 1, or only num_colocated >= 1")
    if not (rate > 0 and workload and num_requests > 0):
        raise ValueError("need rate > 0, a non-empty workload and num_requests > 0")
    rng, t, reqs = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        p, o = workload[rng.randrange(len(workload))]
        reqs.append((t, max(int(p), 1), max(int(o), 1)))
    ws = ([_Worker(i, True, True) for i in range(num_colocated)] if colocated else
          [_Worker(i, i < num_prefill, i >= num_prefill) for i in range(num_prefill + num_decode)])
    ttft, tpot = _run(profile, ws, colocated, reqs)
    e2e = [a + (o - 1) * b if o > 1 else a for a, b, (_, _, o) in zip(ttft, tpot, reqs)]
    limits = [(getattr(slo, k, None), xs)
              for k, xs in (("ttft_s", ttft), ("tpot_s", tpot), ("e2el_s", e2e))]
    good = sum(all(lim is None or math.isnan(xs[i]) or xs[i] <= lim for lim, xs in limits)
               for i in range(num_requests)) / num_requests
    return SimResult(num_prefill, num_decode, num_colocated, rate, good, rate * good,
                     Latency.of(ttft), Latency.of(tpot), Latency.of(e2e))


def recommend(profile: Profile, rate: float, workload: list[tuple[int, int]], slo: Any,
              target: float = 0.9, max_workers: int = 8, seed: int = 0,
              num_requests: int = 2000) -> list[SimResult]:
    """Every P + D <= max_workers and K <= max_workers, fewest workers then best attainment
    first; the recommendation is `cheapest(rows, target)`, the first that reaches it."""
    configs = [(p, n - p, 0) for n in range(2, max_workers + 1) for p in range(1, n)]
    configs += [(0, 0, k) for k in range(1, max_workers + 1)]
    return sorted((simulate(profile, p, d, rate, workload, slo, seed, num_requests, k)
                   for p, d, k in configs), key=lambda r: (r.workers, -r.attainment))


def cheapest(rows: list[SimResult], target: float = 0.9) -> SimResult | None:
    ok = [r for r in rows if r.attainment >= target]
    return min(ok, key=lambda r: (r.workers, -r.attainment)) if ok else None


def assumptions() -> list[str]:
    return [
        "Poisson arrivals; lengths drawn i.i.d. from the workload; N requests from an empty "
        "system (above capacity the queue, and so attainment, depends on N).",
        "Prefill: one request at a time per prefill worker, FCFS from a shared queue. Chunked "
        "prefill on a compute-bound worker only shares it: serial service has equal throughput.",
        "Prefill time is linear in prompt length: no quadratic attention term, no prefix caching.",
        "Decode: continuous batching; a sequence joins the least-loaded decode worker at its next "
        "step boundary; step = base + per_seq * batch; no KV-memory limit, batch cap, preemption.",
        "A fixed per-request overhead (router, network, KV transfer) is added once, to TTFT; "
        "the KV transfer takes no worker compute.",
        "Colocated: a worker runs queued prefills before decode steps (vLLM's priority) and a "
        "prefill stalls its decode batch for its whole duration; chunked prefill spreads that "
        "stall over steps (similar mean TPOT, smaller worst ITL). Same per-worker profile.",
        "The profile holds for the model, hardware and parallelism it was measured on.",
    ]
