"""State and RPCs every worker role shares: the engine, its load, Abort and Stats.

Lifecycle: LOADING (gRPC up, health NOT_SERVING, requests get UNAVAILABLE) → SERVING →
DRAINING (SIGTERM: health NOT_SERVING, new requests UNAVAILABLE, in-flight ones finish) → stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from splitserve.engine import EngineConfig
from splitserve.engine_stats import EngineMonitor
from splitserve.v1 import common_pb2, registry_pb2, worker_pb2

log = logging.getLogger(__name__)

ROLES = {"prefill": registry_pb2.ROLE_PREFILL, "decode": registry_pb2.ROLE_DECODE,
         "colocated": registry_pb2.ROLE_COLOCATED}


@dataclass(frozen=True)
class WorkerConfig:
    role: str  # "prefill" | "decode" | "colocated"
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # gRPC port; 0 picks a free one (printed and registered)
    advertise_host: str | None = None  # what the router dials; defaults to host
    router: str | None = None  # router address to register with; None = static list only
    worker_id: str | None = None
    model_name: str | None = None  # served name; defaults to the model directory's name
    metrics_port: int | None = 0  # Prometheus /metrics; 0 = any free port, None = off
    drain_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {self.role!r}")


class Phase(enum.IntEnum):
    LOADING = 0
    SERVING = 1
    DRAINING = 2


@dataclass
class WorkerCore:
    cfg: WorkerConfig
    served_model: str
    monitor: EngineMonitor = field(default_factory=EngineMonitor)
    engine: object | None = None  # vllm AsyncLLM once loaded
    phase: Phase = Phase.LOADING
    inflight: int = 0  # RPCs being served right now (prefill queue length, drain wait)
    total_kv_blocks: int = 0
    # Prefill role: where this engine's KV producer listens (learnt from the first transfer's
    # params), so Stats can report blocks held for decode workers (copies or vLLM blocks).
    kv_side_channel: tuple[str, int] | None = None

    @contextlib.contextmanager
    def admit(self, context: grpc.aio.ServicerContext) -> Iterator[object]:
        """Count a request in; refuse it while loading or draining."""
        if self.phase is not Phase.SERVING or self.engine is None:
            raise _Unavailable(f"worker is {self.phase.name.lower()}")
        self.inflight += 1
        try:
            yield self.engine
        finally:
            self.inflight -= 1

    def load(self) -> common_pb2.WorkerLoad:
        s = self.monitor.snapshot()
        total = self.total_kv_blocks
        return common_pb2.WorkerLoad(
            queue_len=self.inflight, running=s.num_running, waiting=s.num_waiting,
            free_kv_blocks=round(total * (1.0 - s.kv_cache_usage)), total_kv_blocks=total,
            prefix_cache_hit_rate=(s.prefix_cache_hits / s.prefix_cache_queries
                                   if s.prefix_cache_queries else 0.0))

    async def abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        if self.engine is None:
            return worker_pb2.AbortResponse(found=False)
        await self.engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=True)

    async def held_kv_blocks(self) -> int:
        if self.kv_side_channel is None:
            return 0
        from splitserve.kv.producer import query_status

        try:
            status = await asyncio.to_thread(query_status, *self.kv_side_channel)
        except (OSError, ValueError) as e:
            log.warning("cannot read the KV producer's status: %s", e)
            return -1  # unknown, and visibly so
        return int(status["held_blocks"])

    async def stats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.StatsResponse:
        load = self.load()
        load.held_kv_blocks = await self.held_kv_blocks()
        return worker_pb2.StatsResponse(load=load, role=ROLES[self.cfg.role],
                                        model=self.served_model,
                                        engine_id=self.cfg.engine.engine_id or "")


class _Unavailable(Exception):
    pass


@contextlib.asynccontextmanager
async def rpc_errors(context: grpc.aio.ServicerContext, request_id: str):
    """Map failures to status codes: bad input → INVALID_ARGUMENT, not ready → UNAVAILABLE."""
    try:
        yield
    except _Unavailable as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except ValueError as e:
        log.info("request %s rejected: %s", request_id, e)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
