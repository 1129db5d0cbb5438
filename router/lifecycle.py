"""A request's life, told once to everything in the router that keeps account of it.

Lifecycle, one call per event from the request path (the fronts and router/generation.py), which
tells no tracker itself:

    Tracker.track (arrival, by the front) → admit (the SLO gates may refuse it at once; then a
    slot, waiting in the queue for one) → routed (to workers; again after each migration) →
    received (tokens from the workers) and sent (tokens written to the client; the last one
    finishes it) → migrated (a worker failed it; the rest runs elsewhere) → left (its slot given
    back) → end (its Outcome, unless its last chunk was sent; counted once whichever path ends it)

Who hears what: the metrics (`RequestTrace`: latencies as the client sees them, the outcome
counter, the queue gauges, migrations), the SLO meters (router/slo.py: prompt tokens waiting for
a first token, streams decoding, as the router sees them), the admission queue, the placing
request's meters of conditional disaggregation (router/split.py, one `Track` per attempt), and
the log (refusals, migrations).
"""

from __future__ import annotations

import logging
import time

from router.errors import WorkerFailed
from router.metrics import RequestTrace, RouterMetrics
from router.outcome import ERROR, FINISHED, Outcome, outcome_of
from router.registry import Worker
from router.slo import Admission, DecodeMeter, PrefillMeter, TpotAdmission, TtftAdmission
from router.split import Placement, PrefillSplit, Track

log = logging.getLogger(__name__)


class Tracker:
    """What the router keeps account of across its requests; one per router."""

    def __init__(self, metrics: RouterMetrics, admission: Admission,
                 ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                 split: PrefillSplit | None = None) -> None:
        self.metrics = metrics
        self.admission = admission
        self.prefill_meter = meter = PrefillMeter()
        metrics.prefill_rate.labels(metrics.model).set_function(lambda: meter.rate() or 0.0)
        metrics.pending_prompt_tokens.labels(metrics.model).set_function(lambda: meter.pending)
        self.decode_meter = streams = DecodeMeter()
        metrics.predicted_tpot.labels(metrics.model).set_function(
            lambda: streams.predict_tpot() or 0.0)
        self.ttft_gate = TtftAdmission(ttft_slo_s) if ttft_slo_s is not None else None
        self.tpot_gate = TpotAdmission(tpot_slo_s) if tpot_slo_s is not None else None
        self.split = split

    def track(self, arrival: float | None = None) -> Lifecycle:
        """A request that arrived now, or at `arrival` (time.perf_counter()) where the front
        stamped it earlier."""
        return Lifecycle(self, self.metrics.trace(arrival))


class Lifecycle:
    __slots__ = ("_t", "trace", "request_id", "num_prompt", "admitted_at", "_mark", "_num_out",
                 "_final", "_routed", "_track")

    def __init__(self, tracker: Tracker, trace: RequestTrace) -> None:
        self._t = tracker
        self.trace = trace
        self.request_id = ""
        self.num_prompt = 0
        self.admitted_at: float | None = None  # time.perf_counter() when it got its slot
        self._mark: tuple[float, float] | None = None  # the decode meter's, at the first token
        self._num_out = 0  # tokens received from the workers
        self._final = False  # the last chunk was received
        self._routed = False
        self._track: Track | None = None  # the current attempt's, with conditional placement

    @property
    def arrival(self) -> float:
        return self.trace.arrival

    @property
    def queue_s(self) -> float:
        """From its arrival to its slot."""
        assert self.admitted_at is not None, "admitted"
        return self.admitted_at - self.trace.arrival

    async def admit(self, request_id: str, num_prompt: int) -> None:
        """Waits for a slot; raises Overloaded when an SLO gate or a full queue refuses it. Once
        it returns, `left` must follow."""
        t = self._t
        self.request_id, self.num_prompt = request_id, num_prompt
        if t.ttft_gate is not None:
            t.ttft_gate.check(t.prefill_meter, num_prompt)
        if t.tpot_gate is not None:
            t.tpot_gate.check(t.decode_meter)
        t.prefill_meter.start(num_prompt)
        t.decode_meter.joined()
        waiting, running = t.metrics.waiting_m, t.metrics.running_m
        waiting.inc()
        try:
            await t.admission.acquire()
        except BaseException:
            t.prefill_meter.abandoned(num_prompt)
            t.decode_meter.left(None)
            raise
        finally:
            waiting.dec()
        running.inc()
        self.admitted_at = time.perf_counter()

    def routed(self, prefill: Worker | None, decode: Worker, placement: Placement | None,
               max_tokens: int) -> None:
        """An attempt goes to `decode`, after `prefill` (None: it prefills there); `placement`:
        where conditional disaggregation put it, with `max_tokens` left to stream."""
        if not self._routed:  # the queue's time ends where the first attempt is routed
            self._routed = True
            self.trace.admitted(self.num_prompt, prefill is not None)
        if placement is not None:
            assert self._track is None and self._t.split is not None
            self._track = self._t.split.started(placement, prefill, decode, max_tokens)

    def received(self, num_tokens: int, final: bool) -> None:
        """Tokens came back from the workers; `final`: with them the request is done."""
        t = self._t
        if num_tokens and self._mark is None:
            t.prefill_meter.answered(self.num_prompt)
            self._mark = t.decode_meter.first_token()
        self._num_out += num_tokens
        self._final = final
        if self._track is not None:
            self._track.tokens(num_tokens)

    def migrated(self, error: WorkerFailed, max_tokens: int) -> None:
        """A worker failed the attempt; what is left of the request is routed again."""
        self._t.metrics.migrations_m.inc()
        log.warning("request %s: %s; migrating with %d of %d tokens generated", self.request_id,
                    error, self._num_out, max_tokens)
        self._leave_workers()

    def sent(self, num_tokens: int, final: bool) -> None:
        """A chunk of `num_tokens` has been written to the client; `final`: it was the last."""
        self.trace.tokens(num_tokens)
        if final:
            self._finished(FINISHED)

    def left(self) -> None:
        """The request no longer runs (finished, failed or cancelled): its slot is free."""
        t = self._t
        self._leave_workers()
        if self._mark is None:
            t.prefill_meter.abandoned(self.num_prompt)
        if self._final and self._mark is not None:
            t.decode_meter.finished(self._mark, self._num_out)
        else:
            t.decode_meter.left(self._mark)
        t.metrics.running_m.dec()
        t.admission.release()

    def end(self, error: BaseException | None = None,
            time_remaining: float | None = None) -> Outcome:
        """The front is done with the request: `error` ended it (None: its stream ran out, an
        error unless its last chunk was sent); `time_remaining`: the client's deadline. Returns
        the outcome for the front to render."""
        outcome = ERROR if error is None else outcome_of(error, time_remaining)
        self._finished(outcome)
        return outcome

    def _finished(self, outcome: Outcome) -> None:
        if self.trace.done:
            return
        if outcome.refused:  # the client got a 429/503 (or the gRPC code): the log says why
            log.info("request %s refused (%s): %s", self.request_id, outcome.code.name,
                     outcome.message)
        self.trace.finish(outcome.label)

    def _leave_workers(self) -> None:
        if self._track is not None:
            self._track.close()
            self._track = None
