"""What the router fails a request with: one exception, carrying its gRPC status code.

Everything the router refuses or fails with is a `RequestFailed`; router/outcome.py reads it as
the request's `Outcome` (its label, its HTTP status), which each front renders.
"""

from __future__ import annotations

import grpc


class RequestFailed(Exception):
    """The request ends with `code`; the message is for the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


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


class Overloaded(RequestFailed):
    """Refused now rather than served late (router/slo.py); `retry_after_s` says when the queue
    will have room (gRPC trailer `grpc-retry-pushback-ms`, HTTP header `Retry-After`)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


# The router gives up this long before the client's deadline, so that it, not grpc's timer racing
# it, ends the request: with DEADLINE_EXCEEDED, a message saying where the time went, and the
# "deadline" outcome.
DEADLINE_MARGIN_S = 0.02
