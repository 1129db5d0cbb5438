"""Run the router: one gRPC server with the public Generation service and the internal
Registry, plus health and reflection. Health is SERVING once at least one worker can take a
request, NOT_SERVING before that and while draining on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.config import RouterConfig
from router.generation import GenerationService
from router.registry import WorkerRegistry
from router.text import RouterTokenizer
from splitserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)
SERVICES = [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
            registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name]


async def serve(cfg: RouterConfig, ready_file: str | None = None,
                stop: asyncio.Event | None = None) -> None:
    served = cfg.model_name or Path(cfg.model_dir).name
    registry = WorkerRegistry(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s)
    for role, addrs in (("prefill", cfg.static_prefill), ("decode", cfg.static_decode),
                        ("colocated", cfg.static_colocated)):
        for a in addrs:
            registry.add_static(role, a)
    service = GenerationService(cfg, registry, RouterTokenizer(cfg.model_dir), served)
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    registry_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                        server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    address = f"{cfg.host}:{port}"
    print(f"[splitserve] router: gRPC on {address} serving {served!r}", file=sys.stderr,
          flush=True)
    if ready_file:
        Path(ready_file).write_text(address)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(registry.run(stop)),
             asyncio.ensure_future(_track_health(service, health_servicer, stop))]
    await stop.wait()
    await _set(health_servicer, serving=False)
    await server.stop(grace=5.0)
    await asyncio.gather(*tasks)


async def _track_health(service: GenerationService, h: health.aio.HealthServicer,
                        stop: asyncio.Event) -> None:
    serving = None
    while not stop.is_set():
        try:
            service.route(1 << 30, local=False)
            now = True
        except Exception:
            now = False
        if now != serving:
            await _set(h, now)
            serving = now
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def _set(h: health.aio.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *SERVICES]:
        await h.set(name, status)
