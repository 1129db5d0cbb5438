"""How a request ends (router/outcome.py) and its life as the trackers see it
(router/lifecycle.py): one label, one HTTP status and one gRPC status per way of ending, counted
once, with the slot given back (end to end: tests/e2e/test_cancel.py, test_http.py, test_slo.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from router.errors import InvalidArgument, Overloaded, RequestFailed, WorkerFailed
from router.generation import grpc_trailers
from router.http import api_error
from router.lifecycle import Tracker
from router.metrics import RouterMetrics
from router.outcome import outcome_of
from router.slo import Admission

S = grpc.StatusCode


@pytest.mark.parametrize(("error", "time_remaining", "label", "code", "http", "headers"), [
    (InvalidArgument("sampling.top_p", "bad"), None, "invalid", S.INVALID_ARGUMENT, 400, None),
    (InvalidArgument("model", "unknown"), None, "invalid", S.INVALID_ARGUMENT, 404, None),
    (Overloaded("full", 0.5), None, "rejected", S.RESOURCE_EXHAUSTED, 429, {"Retry-After": "1"}),
    (WorkerFailed("w0", "gone"), None, "unavailable", S.UNAVAILABLE, 503, {"Retry-After": "1"}),
    (RequestFailed(S.DEADLINE_EXCEEDED, "late"), None, "deadline", S.DEADLINE_EXCEEDED, 504, None),
    (RequestFailed(S.INTERNAL, "template"), None, "error", S.INTERNAL, 500, None),
    (asyncio.CancelledError(), 5.0, "cancelled", S.CANCELLED, 499, None),
    (asyncio.CancelledError(), 0.1, "deadline", S.DEADLINE_EXCEEDED, 504, None),
    (GeneratorExit(), None, "cancelled", S.CANCELLED, 499, None),
    (ValueError("a bug"), None, "error", S.UNKNOWN, 500, None),
])
def test_each_way_of_ending_has_one_label_and_status(error, time_remaining, label, code, http,
                                                    headers) -> None:
    outcome = outcome_of(error, time_remaining)
    assert (outcome.label, outcome.code) == (label, code)
    if isinstance(error, RequestFailed):
        e = api_error(outcome)
        assert (e.status, e.headers) == (http, headers)
        assert e.param == (error.field.removeprefix("sampling.")
                           if isinstance(error, InvalidArgument) else None)
        assert grpc_trailers(outcome) == ((("grpc-retry-pushback-ms", "500"),)
                                          if isinstance(error, Overloaded) else ())
    else:
        assert outcome.http_status == http


def test_a_request_is_counted_once_and_gives_its_slot_back() -> None:
    reg = CollectorRegistry()
    tracker = Tracker(RouterMetrics(reg, "m"), Admission(max_concurrency=1, max_queue=0))

    def count(outcome: str) -> float | None:
        return reg.get_sample_value("splitserve:requests_total",
                                    {"model_name": "m", "outcome": outcome})

    async def main() -> None:
        served = tracker.track()
        await served.admit("a", 4)
        refused = tracker.track()
        with pytest.raises(Overloaded) as e:  # the only slot is taken and no one may wait
            await refused.admit("b", 4)
        assert refused.end(e.value).label == "rejected"
        for final in (False, True):
            served.received(1, final)
            served.sent(1, final)
        served.left()
        served.end()  # its last chunk finished it: nothing more is counted
        served.end(asyncio.CancelledError())
        again = tracker.track()
        await again.admit("c", 4)  # the slot is free again
        again.left()
        again.end()  # its stream ran out without a last chunk

    asyncio.run(main())
    counts = [count(o) for o in ("finished", "rejected", "cancelled", "error")]
    assert counts == [1, 1, 0, 1]
    assert tracker.admission.running == 0 and tracker.decode_meter.decoding == 0
    assert tracker.prefill_meter.pending == 0 and tracker.decode_meter.joining == 0
