"""The HTTP front's connections: kept open as long as clients expect, and every close counted.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive` (its default: 5 s). A
client that keeps idle connections in a pool for longer (aiohttp, which AIPerf uses: 15 s; Go's
net/http: 90 s) can pick one the moment the server closes it, and its request is lost before it
is sent ("Cannot write to closing transport", `ServerDisconnectedError`): nothing reaches the
router, so neither its log nor its metrics saw those losses. The rule that avoids the race is
that the server keeps an idle connection longer than its clients do, so the client always closes
first (`KEEP_ALIVE_S`).

`counting_protocol` wraps uvicorn's HTTP protocol so that every connection's end is counted
(`splitserve:http_connections_closed_total`, by who closed it and why) and the ones the server
closes are logged with the peer's address.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)

# Longer than the idle time of the client pools people use (aiohttp 15 s, Go 90 s, httpx 5 s):
# the client closes an idle connection before the server does.
KEEP_ALIVE_S = 95.0

# (who closed it, why): the label values of the closed-connections counter.
CLOSES = (("server", "idle_timeout"), ("server", "bad_request"), ("server", "shutdown"),
          ("client", "idle"), ("client", "mid_request"))


class ConnectionMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        opened = Counter("splitserve:http_connections_opened", "HTTP connections accepted",
                         ["model_name"], registry=registry)
        closed = Counter("splitserve:http_connections_closed",
                         "HTTP connections ended, by the side that closed them and why "
                         "(server: idle_timeout, bad_request, shutdown; client: idle, "
                         "mid_request)", ["model_name", "by", "reason"], registry=registry)
        self.opened = opened.labels(model)
        self.closed = {key: closed.labels(model, *key) for key in CLOSES}


def counting_protocol(metrics: ConnectionMetrics) -> type:
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks), counting closes."""

    class CountingProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _closed_by: tuple[str, str] | None = None

        def connection_made(self, transport) -> None:
            metrics.opened.inc()
            super().connection_made(transport)

        def timeout_keep_alive_handler(self) -> None:
            self._server_closes("idle_timeout", logging.INFO)
            super().timeout_keep_alive_handler()

        def send_400_response(self, msg: str) -> None:
            self._server_closes("bad_request", logging.WARNING)
            super().send_400_response(msg)

        def shutdown(self) -> None:
            self._server_closes("shutdown", logging.INFO)  # now, or once its answer is sent
            super().shutdown()

        def connection_lost(self, exc) -> None:
            if self._closed_by is None:
                busy = self.cycle is not None and not self.cycle.response_complete
                self._closed_by = ("client", "mid_request" if busy else "idle")
            metrics.closed[self._closed_by].inc()
            super().connection_lost(exc)

        def _server_closes(self, reason: str, level: int) -> None:
            if self._closed_by is None and not self.transport.is_closing():
                self._closed_by = ("server", reason)
                log.log(level, "HTTP connection from %s closed by the server: %s",
                        _peer(self.client), reason)

    return CountingProtocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
