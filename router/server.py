"""Run the router: one gRPC server with the public Generation service and the internal
Registry, plus health and reflection. Health is SERVING once at least one worker can take a
request, NOT_SERVING before that and while draining on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from router.config import RouterConfig
from router.errors import RequestFailed
from router.generation import GenerationService
from router.http import build_app
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from router.text import RouterTokenizer
from splitserve.health import set_serving
from splitserve.roles import Role
from splitserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)
SERVICES = [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
            registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name]


async def serve(cfg: RouterConfig, ready_file: str | None = None,
                stop: asyncio.Event | None = None) -> None:
    served = cfg.model_name or Path(cfg.model_dir).name
    metrics_registry = CollectorRegistry()
    metrics = RouterMetrics(metrics_registry, served)
    registry = WorkerRegistry(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s)
    for role, addrs in ((Role.PREFILL, cfg.static_prefill), (Role.DECODE, cfg.static_decode),
                        (Role.COLOCATED, cfg.static_colocated)):
        for a in addrs:
            registry.add_static(role, a)
    service = GenerationService(cfg, registry, RouterTokenizer(cfg.model_dir), served, metrics)
    interceptors = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
    server = grpc.aio.server(interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    registry_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                        server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    address = f"{cfg.host}:{port}"
    endpoints = {"grpc": address}
    http_task = None
    if cfg.http_port is not None:
        sock = socket.create_server((cfg.host, cfg.http_port))
        # Accepted connections inherit it. Without it, Nagle held each stream's first small
        # write until the client's delayed ACK: ~40 ms on every time to first token.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        endpoints["http"] = f"http://{cfg.host}:{sock.getsockname()[1]}"
        app = build_app(service, metrics_registry, cfg.api_key)
        http = _QuietServer(uvicorn.Config(app, log_level="warning", lifespan="off"))
        http_task = asyncio.ensure_future(http.serve(sockets=[sock]))
    print(f"[splitserve] router: gRPC on {address}"
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
    await set_serving(health_servicer, SERVICES, False)
    if http_task is not None:
        http.should_exit = True
        await http_task
    await server.stop(grace=5.0)
    await asyncio.gather(*tasks)


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the router owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` on the public Generation service (workers' Registry calls
    and health checks stay open: they are internal)."""

    def __init__(self, key: str) -> None:
        self._expected = f"Bearer {key}"

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/splitserve.v1.Generation/"):
            md = dict(details.invocation_metadata or ())
            if md.get("authorization") != self._expected:
                return _deny(details.method)
        return await continuation(details)


def _deny(method: str):
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")
        yield  # pragma: no cover

    if method.endswith("/Generate"):
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


async def _track_health(service: GenerationService, h: health.aio.HealthServicer,
                        metrics: RouterMetrics, stop: asyncio.Event) -> None:
    serving = None
    while not stop.is_set():
        for role in Role:
            metrics.workers.labels(metrics.model, role.value).set(len(service.registry.alive(role)))
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

