"""Run the router: a gRPC server with the public Generation service and the internal Registry
(or the Registry on a cluster port of its own), plus health and reflection. Health is SERVING
once at least one worker can take a request, NOT_SERVING before that and while draining.

Who may call what (docs/security.md): Generation and HTTP /v1 want an API key, the Registry the
cluster credential (splitserve/credentials.py); with TLS every listener speaks it, and the cluster
port demands a client certificate signed by the CA (splitserve/tls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from router.config import RouterConfig
from router.connections import KEEP_ALIVE_S, ConnectionMetrics, counting_protocol
from router.errors import RequestFailed
from router.generation import GenerationService
from router.http import build_app
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from router.text import RouterTokenizer
from splitserve.credentials import Access, ticket_key
from splitserve.health import set_serving
from splitserve.roles import Role
from splitserve.tls import add_port, warn_if_exposed
from splitserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)
SERVICES = [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
            registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name]


async def serve(cfg: RouterConfig, ready_file: str | None = None,
                stop: asyncio.Event | None = None) -> None:
    served = cfg.model_name or Path(cfg.model_dir).name
    metrics_registry = CollectorRegistry()
    metrics = RouterMetrics(metrics_registry, served)
    registry = WorkerRegistry(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s, cfg.tls,
                              cfg.cluster_token, ticket_key(cfg.cluster_token))
    for role, addrs in ((Role.PREFILL, cfg.static_prefill), (Role.DECODE, cfg.static_decode),
                        (Role.COLOCATED, cfg.static_colocated)):
        for a in addrs:
            registry.add_static(role, a)
    service = GenerationService(cfg, registry, RouterTokenizer(cfg.model_dir), served, metrics)
    access = Access(cfg.api_keys, cfg.cluster_token)
    interceptors = [i for i in [access.interceptor()] if i is not None]
    # grpc's own default is 4 MiB; ours is the same limit as the HTTP body's, and a flag.
    size = cfg.limits.max_request_bytes
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", size)])
    generation_pb2_grpc.add_GenerationServicer_to_server(service, _StrictParsing(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    servers = [server]
    if cfg.cluster_port is None:
        registry_pb2_grpc.add_RegistryServicer_to_server(registry, server)
        if cfg.tls is not None and cfg.tls.ca:
            log.warning("the Registry shares the public port, which cannot demand client "
                        "certificates: give it --cluster-port for mutual TLS")
    else:
        cluster = grpc.aio.server(interceptors=interceptors)
        registry_pb2_grpc.add_RegistryServicer_to_server(registry, cluster)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, cluster)
        servers.append(cluster)
    reflection.enable_server_reflection([*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                        server)
    port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls, client_auth=False)
    address = f"{cfg.host}:{port}"
    endpoints = {"grpc": address}
    if cfg.cluster_port is not None:
        cport = add_port(cluster, f"{cfg.host}:{cfg.cluster_port}", cfg.tls,
                         client_auth=cfg.tls is not None and cfg.tls.ca is not None)
        endpoints["cluster"] = f"{cfg.host}:{cport}"
    for s in servers:
        await s.start()
    http_task = None
    if cfg.http_port is not None:
        sock = socket.create_server((cfg.host, cfg.http_port))
        # Accepted connections inherit it. Without it, Nagle held each stream's first small
        # write until the client's delayed ACK: ~40 ms on every time to first token.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        scheme = "https" if cfg.tls else "http"
        endpoints["http"] = f"{scheme}://{cfg.host}:{sock.getsockname()[1]}"
        if cfg.tls is None:
            warn_if_exposed(cfg.host, "HTTP")
        app = build_app(service, metrics_registry, cfg.api_keys)
        tls = {} if cfg.tls is None else {"ssl_certfile": cfg.tls.cert,
                                          "ssl_keyfile": cfg.tls.key}
        protocol = counting_protocol(ConnectionMetrics(metrics_registry, served))
        http = _QuietServer(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=protocol, timeout_keep_alive=KEEP_ALIVE_S,
                                           timeout_graceful_shutdown=cfg.drain_timeout_s, **tls))
        http_task = asyncio.ensure_future(http.serve(sockets=[sock]))
    print(f"[splitserve] router: gRPC on {address}"
          + (f", cluster (Registry) on {endpoints['cluster']}" if "cluster" in endpoints else "")
          + (f", HTTP (OpenAI API, /metrics) on {endpoints['http']}" if http_task else "")
          + f", serving {served!r}", file=sys.stderr, flush=True)
    if ready_file:
        Path(ready_file).write_text(json.dumps(endpoints))

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(registry.run(stop)),
             asyncio.ensure_future(_track_health(service, health_servicer, metrics, stop))]
    await stop.wait()
    # Drain: NOT_SERVING, no new calls on either front, in-flight requests finish (bounded).
    await set_serving(health_servicer, SERVICES, False)
    log.info("router draining: %d request(s) in flight", service.tracker.admission.running)
    if http_task is not None:
        http.should_exit = True
    await asyncio.gather(*(s.stop(grace=cfg.drain_timeout_s) for s in servers),
                         *([http_task] if http_task is not None else []))
    await asyncio.gather(*tasks)


@dataclass(frozen=True)
class _Malformed:
    error: str


class _StrictParsing:
    """Registers a generated servicer with request parsing that answers INVALID_ARGUMENT.

    grpc answers bytes that do not parse as the request message with UNKNOWN and logs a
    traceback for each: found by fuzzing (tests/e2e/test_fuzz.py), a cheap way to fill the
    router's log. Stands in for the server during `add_*Servicer_to_server`, which builds the
    handlers; registers them with a parser that cannot raise."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the generated code registers the same handlers below, where we wrap them

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        strict = {name: _strict(h) for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, strict),))
        self._server.add_registered_method_handlers(service, strict)


def _strict(h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    assert not (h.request_streaming or inspect.isasyncgenfunction(h.unary_stream)), \
        "unary requests and coroutine handlers only"
    parse, behavior = h.request_deserializer, h.unary_unary or h.unary_stream

    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except DecodeError as e:
            return _Malformed(str(e))

    async def handle(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid message: {request.error}")
        return await behavior(request, context)

    kind = "unary_unary" if h.unary_unary else "unary_stream"
    return h._replace(request_deserializer=deserialize, **{kind: handle})


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the router owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _track_health(service: GenerationService, h: health.aio.HealthServicer,
                        metrics: RouterMetrics, stop: asyncio.Event) -> None:
    serving = None
    while not stop.is_set():
        alive = {role: service.registry.alive(role) for role in Role}
        for role, workers in alive.items():
            metrics.workers.labels(metrics.model, role.value).set(len(workers))
        if service.split is not None:  # what it measured of departed workers goes with them
            service.split.forget_except({w.worker_id for ws in alive.values() for w in ws})
        try:
            service.route(1 << 30, local=False)
            now = True
        except RequestFailed:
            now = False
        if now != serving:
            await set_serving(h, SERVICES, now)
            serving = now
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass

