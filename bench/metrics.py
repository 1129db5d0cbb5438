"""Per-request timings, SLOs and the summary a load-test run reports.

Summary keys follow vLLM's benchmark_serving result JSON (mean_ttft_ms, p99_itl_ms,
request_goodput, ...) so results can be compared and plotted with the same tooling. Goodput is
DistServe's notion: requests per second that met every latency SLO, which is what a
disaggregated deployment is tuned for, rather than raw throughput.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from splitserve.slo import SLO

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are absolute time.perf_counter() seconds."""

    ok: bool
    start: float  # when the request was sent
    chunk_times: list[float]  # arrival of each streamed chunk carrying >= 1 token
    chunk_tokens: list[int]  # tokens in each of those chunks
    end: float  # when the stream finished (or failed)
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    # Server-reported phases in seconds (queue_s, prefill_s, transfer_s, decode_s); may be empty.
    server: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first. Derived from token counts, not chunk gaps:
        a chunk can carry several tokens, so gaps alone would overstate it."""
        ttft = self.ttft
        if ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks (inter-token latency as streamed)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def streams_at_first_token(results: Sequence[RequestResult]) -> list[int | None]:
    """For each request, how many others were streaming (between their first token and their
    last) when its first token arrived; None for a request without one. Zero means the decode
    side had nothing else to run when this request's KV was on its way, so its next step could
    start as soon as the KV landed; otherwise a step of the others' was under way, and the
    request waits for it to end (up to one step) before its own."""
    spans = [(r.chunk_times[0], r.chunk_times[-1]) for r in results if r.ok and r.chunk_times]
    starts = sorted(a for a, _ in spans)
    ends = sorted(b for _, b in spans)

    def streaming(t: float) -> int:  # started before t, not ended before it (itself starts at t)
        return bisect.bisect_left(starts, t) - bisect.bisect_left(ends, t)

    return [streaming(r.chunk_times[0]) if r.ok and r.chunk_times else None for r in results]


def _pword(p: float) -> str:
    # vLLM's key spelling: p99, p99.9.
    return str(int(p)) if float(p) == int(p) else str(p)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean/median/std/percentiles in ms. Empty input gives 0.0, not NaN, so JSON stays valid."""
    ms = np.asarray(values_s, dtype=float) * 1e3
    out: dict[str, float] = {}
    empty = ms.size == 0
    out[f"mean_{name}_ms"] = 0.0 if empty else float(np.mean(ms))
    out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(ms))
    out[f"std_{name}_ms"] = 0.0 if empty else float(np.std(ms))
    for p in percentiles:
        out[f"p{_pword(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def summarize(
    results: list[RequestResult],
    duration: float,
    slo: SLO | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict:
    """Aggregate a run. Latencies and token totals are over successful requests only;
    slo_attainment is over all requests (a failure is a miss)."""
    if not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be finite and > 0, got {duration}")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {p}")
    done = [r for r in results if r.ok]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    out: dict = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    good = sum(1 for r in results if slo.meets(r)) if slo is not None else 0
    if slo is not None:
        out["request_goodput"] = good / duration
    per_metric = {
        "ttft": [t for r in done if (t := r.ttft) is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.itls],
        "e2el": [r.e2e for r in done],
    }
    for name in METRICS:
        out.update(_stats(name, per_metric[name], percentiles))
    out["slo_attainment"] = (
        None if slo is None else (good / len(results) if results else 0.0)
    )
    # Server-side phases: where the time went (queue vs prefill vs KV transfer vs decode).
    keys = sorted({k for r in done for k in r.server})
    for k in keys:
        vals = [r.server[k] for r in done if k in r.server]
        base = k[:-2] if k.endswith("_s") else k
        # A server key such as ttft_s must not overwrite the client-side number.
        name = f"mean_{base}_ms" if f"mean_{base}_ms" not in out else f"mean_server_{base}_ms"
        out[name] = float(np.mean(vals)) * 1e3
    return out


def max_goodput_rate(points: list[tuple[float, float]], target: float = 0.9) -> float | None:
    """The largest swept rate whose SLO attainment reached target, or None if none did.

    Taken as measured: no interpolation between rates and no requirement that lower rates also
    passed, since a sweep is usually too coarse for either to add information."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    ok = [rate for rate, att in points if att is not None and att >= target]
    return max(ok) if ok else None
