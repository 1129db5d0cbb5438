"""gRPC health (grpc.health.v1) for every server: one switch for the overall and named services."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2


async def set_serving(h: health.aio.HealthServicer, services: list[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *services]:  # "" is the server as a whole (what probes ask by default)
        await h.set(name, status)
