"""How a request ended, written once: the record both fronts render and the trackers count.

A request ends exactly one way: its last chunk went out (finished), or something stopped it -- a
`RequestFailed` (router/errors.py: invalid, refused, no worker, deadline, a worker's failure
past migration), the client leaving or its deadline cancelling the handler, or a bug. `outcome_of`
reads that into an `Outcome`; router/lifecycle.py counts it under its label, the gRPC service
renders it as a status (router/generation.py) and the HTTP front as a status and an OpenAI error
body (router/http.py). The tables below are the one place a status meets its label.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from router.errors import InvalidArgument, Overloaded, RequestFailed

# The gRPC code a request ends with → its label (splitserve:requests_total{outcome}) and HTTP
# status. Any other code is an "error" and a 500.
_ENDS = {grpc.StatusCode.OK: ("finished", 200),
         grpc.StatusCode.CANCELLED: ("cancelled", 499),
         grpc.StatusCode.DEADLINE_EXCEEDED: ("deadline", 504),
         grpc.StatusCode.RESOURCE_EXHAUSTED: ("rejected", 429),
         grpc.StatusCode.INVALID_ARGUMENT: ("invalid", 400),
         grpc.StatusCode.UNAVAILABLE: ("unavailable", 503)}
_OTHER = ("error", 500)
LABELS = (*(label for label, _ in _ENDS.values()), _OTHER[0])

# The client's clock starts before ours (its deadline is set when it sends; ours when the headers
# are parsed here), so on a loaded host its timer can fire first and reach us as a plain cancel
# with some time still left by our clock: a cancel this close to the deadline is the deadline.
# (A client that leaves on purpose within the last quarter second is counted as timed out.)
DEADLINE_CANCEL_WINDOW_S = 0.25


@dataclass(frozen=True, slots=True)
class Outcome:
    code: grpc.StatusCode  # OK when the request finished
    message: str = ""  # for the client: says what failed, and where
    retry_after_s: float | None = None  # a refusal's hint of when the queue will have room
    field: str | None = None  # the request field an invalid argument names (its proto path)

    @property
    def label(self) -> str:
        return _ENDS.get(self.code, _OTHER)[0]

    @property
    def http_status(self) -> int:
        return _ENDS.get(self.code, _OTHER)[1]

    @property
    def refused(self) -> bool:
        """Turned away rather than failed (overload, no worker): the client should come back."""
        return self.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


FINISHED = Outcome(grpc.StatusCode.OK)
ERROR = Outcome(grpc.StatusCode.UNKNOWN, "internal error")  # what nothing else explains


def outcome_of(e: BaseException, time_remaining: float | None = None) -> Outcome:
    """What ending a request with `e` means. A cancellation (`time_remaining`: the client's
    deadline, where it has one) is its deadline when that was about to pass, else the client
    leaving (an HTTP client's disconnect reaches a stream as GeneratorExit)."""
    if isinstance(e, RequestFailed):
        return Outcome(e.code, str(e),
                       retry_after_s=e.retry_after_s if isinstance(e, Overloaded) else None,
                       field=e.field if isinstance(e, InvalidArgument) else None)
    if isinstance(e, asyncio.CancelledError | GeneratorExit):
        deadline = time_remaining is not None and time_remaining <= DEADLINE_CANCEL_WINDOW_S
        return Outcome(grpc.StatusCode.DEADLINE_EXCEEDED if deadline
                       else grpc.StatusCode.CANCELLED)
    return ERROR
