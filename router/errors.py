"""How a request ends when it does not finish: one exception, one status table.

Everything the router refuses or fails with is a `RequestFailed` carrying its gRPC code; the gRPC
service aborts with it, the HTTP front turns it into an OpenAI error with the HTTP status below,
and both record the same outcome label in the metrics.
"""

from __future__ import annotations

import grpc

# Outcome label (splitserve:requests_total{outcome}) and HTTP status of each code we end with.
_OUTCOME = {grpc.StatusCode.INVALID_ARGUMENT: "invalid",
            grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
            grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
            grpc.StatusCode.CANCELLED: "cancelled"}
_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
         grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
         grpc.StatusCode.CANCELLED: 499}


class RequestFailed(Exception):
    """The request ends with `code`; the message is for the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def outcome(self) -> str:
        return _OUTCOME.get(self.code, "error")

    @property
    def http_status(self) -> int:
        return _HTTP.get(self.code, 500)


class InvalidArgument(RequestFailed):
    """A client error in one request field; the message names the field (its proto path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")
        self.field = field
        self.message = message


class WorkerFailed(RequestFailed):
    """A worker failed the request (died, broke its stream, answered with an error of its own):
    the router may run what is left of it on other workers (generation.py, migration)."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.worker_id = worker_id


# The router gives up this long before the client's deadline, so that it, not grpc's timer racing
# it, ends the request: with DEADLINE_EXCEEDED, a message saying where the time went, and the
# "deadline" outcome.
DEADLINE_MARGIN_S = 0.02
# The client's clock starts before ours (its deadline is set when it sends; ours when the headers
# are parsed here), so on a loaded host its timer can fire first and reach us as a plain cancel
# with some time still left by our clock: a cancel this close to the deadline is the deadline.
# (A client that leaves on purpose within the last quarter second is counted as timed out.)
DEADLINE_CANCEL_WINDOW_S = 0.25


def cancelled_outcome(time_remaining: float | None) -> str:
    """A request whose handler was cancelled: by its deadline, or by the client leaving."""
    return ("deadline" if time_remaining is not None and time_remaining <= DEADLINE_CANCEL_WINDOW_S
            else "cancelled")
