"""SLO-aware admission: refuse at once a request that would miss its TTFT or TPOT SLO.

A request admitted into a queue it cannot get through in time is served late, and it makes every
request behind it late too; refused at once, with a hint of when to come back, it can go to
another replica or retry after the burst. Off unless the deployment sets a TTFT SLO
(`--admit-ttft-slo`); off is the plain queue (`Admission`, below).

The prediction is the pool's own recent speed (`PrefillMeter`): the prompt tokens admitted and
not yet answered with a first token, plus this prompt, divided by the prompt tokens the pool has
recently turned into first tokens per second of being busy. It learns from the router's own
requests, so it follows the model, the hardware, the prompt mix and the number of workers
without a configured number, and it is pessimistic where the pool's prefix cache saves work
(a cached prefix is counted as if it were prefilled). Until it has seen a few requests it admits
everything.

The time per output token (`--admit-tpot-slo`) is predicted the same way, from the router's own
streams (`DecodeMeter`): each finished request gives its TPOT as its client saw it and the mean
number of streams decoding beside it, and a decayed least-squares line through those samples
(TPOT = a + b * streams: a decode step grows with its batch) is read at the streams that will be
decoding once this request joins (those decoding now, those admitted and still prefilling, and
this one). Where the samples all saw about the same number of streams the line has no slope to
go on, and the prediction is their mean TPOT.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.errors import Overloaded

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


class DecodeMeter:
    """Streams decoding and joining, and how a stream's time per output token grows with them.

    Lifecycle per request: `joined()` when admitted, `first_token()`, then `finished(tokens)`
    (or `left()` at any point). Samples come from finished requests of at least two tokens."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.decoding = 0  # streams between their first and last token
        self.joining = 0  # admitted, first token not yet sent
        self._area = 0.0  # integral of `decoding` over time: a request's mean batch
        self._last = clock()
        # Decayed sums for the line TPOT = a + b * streams, and for the mean decode duration.
        self._w = self._x = self._y = self._xx = self._xy = self._dur = 0.0
        self._samples = 0

    def _tick(self) -> float:
        now = self._clock()
        self._area += self.decoding * (now - self._last)
        self._last = now
        return self._area

    def joined(self) -> None:
        self.joining += 1

    def first_token(self) -> tuple[float, float]:
        """The request's first token went out; returns its mark for `finished`."""
        area = self._tick()
        self.joining -= 1
        self.decoding += 1
        return self._last, area

    def left(self, mark: tuple[float, float] | None) -> None:
        """The request ended without a usable sample (refused, failed, cancelled, one token)."""
        self._tick()
        if mark is None:
            self.joining -= 1
        else:
            self.decoding -= 1

    def finished(self, mark: tuple[float, float], tokens: int) -> None:
        """The request's last token went out; `tokens` it streamed in all."""
        area = self._tick()
        self.decoding -= 1
        t0, area0 = mark
        span = self._last - t0
        if tokens < 2 or span <= 0:
            return
        x, y = (area - area0) / span, span / (tokens - 1)
        d = _DECAY
        self._w, self._x, self._y = self._w * d + 1, self._x * d + x, self._y * d + y
        self._xx, self._xy = self._xx * d + x * x, self._xy * d + x * y
        self._dur = self._dur * d + span
        self._samples += 1

    def predict_tpot(self) -> float | None:
        """Seconds per output token for a request admitted now, or None while it knows too
        little."""
        if self._samples < _MIN_SAMPLES:
            return None
        self._tick()
        w, mx, my = self._w, self._x / self._w, self._y / self._w
        var = self._xx / w - mx * mx
        slope = max((self._xy / w - mx * my) / var, 0.0) if var > _MIN_STREAM_VARIANCE else 0.0
        return my + slope * (self.decoding + self.joining + 1 - mx)

    def mean_decode_s(self) -> float:
        return self._dur / self._w if self._w else 0.0


# Below this spread of streams (a variance, in streams squared) the samples say nothing of how
# TPOT grows with the batch.
_MIN_STREAM_VARIANCE = 0.25


@dataclass(frozen=True)
class TpotAdmission:
    """Refuses what the meter predicts would stream slower than `slo_s` per output token."""

    slo_s: float

    def __post_init__(self) -> None:
        if not self.slo_s > 0:
            raise ValueError(f"the TPOT SLO must be positive, got {self.slo_s}")

    def check(self, meter: DecodeMeter) -> None:
        """Raises RESOURCE_EXHAUSTED (HTTP 429) with a retry-after when the SLO would be missed."""
        predicted = meter.predict_tpot()
        if predicted is None or predicted <= self.slo_s:
            return
        streams = meter.decoding + meter.joining
        # About when one of the streams ahead will have finished and left its place.
        wait = max(meter.mean_decode_s() / max(streams, 1), 0.1)
        raise Overloaded(
            f"predicted time per output token {predicted * 1e3:.1f} ms exceeds the SLO of "
            f"{self.slo_s * 1e3:g} ms ({meter.decoding} streams decoding, {meter.joining} "
            f"joining); retry after {math.ceil(wait)} s", wait)


@dataclass
class Admission:
    """`max_concurrency` slots and at most `max_queue` requests waiting for one."""

    max_concurrency: int
    max_queue: int

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self.waiting = 0
        self.running = 0

    async def acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.max_queue:
            # Retry-After: a slot frees as often as a request ends; a second is a fair floor.
            raise Overloaded(f"overloaded: {self.running} running and {self.waiting} queued "
                             f"(max_queue {self.max_queue}); retry later", 1.0)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()
