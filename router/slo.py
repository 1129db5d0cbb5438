"""SLO-aware admission: refuse at once a request that would miss its time-to-first-token SLO.

A request admitted into a queue it cannot get through in time is served late, and it makes every
request behind it late too; refused at once, with a hint of when to come back, it can go to
another replica or retry after the burst. Off unless the deployment sets a TTFT SLO
(`--admit-ttft-slo`); off is the plain queue (router/generation.py, `Admission`).

The prediction is the pool's own recent speed (`PrefillMeter`): the prompt tokens admitted and
not yet answered with a first token, plus this prompt, divided by the prompt tokens the pool has
recently turned into first tokens per second of being busy. It learns from the router's own
requests, so it follows the model, the hardware, the prompt mix and the number of workers
without a configured number, and it is pessimistic where the pool's prefix cache saves work
(a cached prefix is counted as if it were prefilled). Until it has seen a few requests it admits
everything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from router.errors import RequestFailed

# Each answered request weighs this much less than the one after it: a memory of roughly the last
# ten, so the rate follows a change of load or of workers within seconds.
_DECAY = 0.9
_MIN_SAMPLES = 3  # requests answered before the meter predicts anything


class PrefillMeter:
    """Prompt tokens waiting for their first token, and the rate the pool answers them at."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.pending = 0  # prompt tokens admitted, first token not yet sent
        self._busy_s = 0.0  # (decayed) time with something pending, up to the last answer
        self._tokens = 0.0  # (decayed) prompt tokens answered in that time
        self._since = 0.0  # busy time since the last answer
        self._samples = 0
        self._last = clock()

    def _tick(self) -> None:
        now = self._clock()
        if self.pending > 0:
            self._since += now - self._last
        self._last = now

    def start(self, n: int) -> None:
        self._tick()
        self.pending += n

    def answered(self, n: int) -> None:
        """The request of `n` prompt tokens got its first token."""
        self._tick()
        self.pending -= n
        self._busy_s = self._busy_s * _DECAY + self._since
        self._since = 0.0
        self._tokens = self._tokens * _DECAY + n
        self._samples += 1

    def abandoned(self, n: int) -> None:
        """The request ended before its first token (refused, cancelled, failed)."""
        self._tick()
        self.pending -= n

    def rate(self) -> float | None:
        """Prompt tokens per busy second, or None while it knows too little."""
        if self._samples < _MIN_SAMPLES or self._busy_s <= 0:
            return None
        return self._tokens / self._busy_s

    def predict_ttft(self, n: int) -> float | None:
        """Seconds until a prompt of `n` tokens admitted now would get its first token."""
        self._tick()
        rate = self.rate()
        return None if rate is None else (self.pending + n) / rate


@dataclass(frozen=True)
class TtftAdmission:
    """Refuses what the meter predicts would wait longer than `slo_s` for its first token."""

    slo_s: float

    def __post_init__(self) -> None:
        if not self.slo_s > 0:
            raise ValueError(f"the TTFT SLO must be positive, got {self.slo_s}")

    def check(self, meter: PrefillMeter, n: int) -> None:
        """Raises RESOURCE_EXHAUSTED (HTTP 429) with a retry-after when the SLO would be missed."""
        predicted = meter.predict_ttft(n)
        if predicted is None or predicted <= self.slo_s:
            return
        rate = meter.rate() or 1.0
        # When enough of the queue ahead has drained for this prompt to make it in time.
        wait = max(predicted - self.slo_s, 0.1)
        raise Overloaded(
            f"predicted time to first token {predicted:.2f} s exceeds the SLO of "
            f"{self.slo_s:g} s ({meter.pending} prompt tokens ahead of this one's {n}, "
            f"answered at {rate:.0f} tokens/s); retry after {math.ceil(wait)} s", wait)


class Overloaded(RequestFailed):
    """Refused now rather than served late; `retry_after_s` says when the queue will have room
    (gRPC trailer `grpc-retry-pushback-ms`, HTTP header `Retry-After`)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s

    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        return (("grpc-retry-pushback-ms", str(math.ceil(self.retry_after_s * 1000))),)

    def http_headers(self) -> dict[str, str]:
        return {"Retry-After": str(math.ceil(self.retry_after_s))}
