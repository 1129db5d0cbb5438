"""State and RPCs every worker role shares: the engine, its load, and Stats.

Lifecycle: LOADING (gRPC up, health NOT_SERVING, requests get UNAVAILABLE) → SERVING →
DRAINING (SIGTERM: health NOT_SERVING, new requests UNAVAILABLE, in-flight ones finish) → stopped.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from splitserve.credentials import ticket_key
from splitserve.engine_stats import EngineMonitor
from splitserve.faults import Faults, for_host
from splitserve.kv.board import read_board
from splitserve.roles import Role
from splitserve.v1 import common_pb2, worker_pb2
from splitserve.worker.config import WorkerConfig
from splitserve.worker.errors import PermissionDenied, Unavailable

log = logging.getLogger(__name__)


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
    kv_address: str = ""  # prefill: the KV side channel's host:port, once the engine is up
    faults: Faults = field(init=False)  # tests only (splitserve/faults.py); refused off loopback

    def __post_init__(self) -> None:
        self.faults = for_host(self.cfg.host)

    @functools.cached_property
    def ticket_key(self) -> bytes | None:
        return ticket_key(self.cfg.cluster_token)

    @contextlib.contextmanager
    def admit(self) -> Iterator[object]:
        """Count a request in; refuse it while loading or draining."""
        if self.phase is not Phase.SERVING or self.engine is None:
            raise Unavailable(f"worker is {self.phase.name.lower()}")
        self.inflight += 1
        try:
            yield self.engine
        finally:
            self.inflight -= 1

    def kv_transfers(self) -> dict[str, int]:
        """Prefill role: the producer's transfers by state and the blocks it holds, as it last
        published them (at every change); {} for other roles or before the engine is up."""
        board = self.cfg.engine.kv_settings.status_file
        return read_board(board) if board and self.cfg.role is Role.PREFILL else {}

    def load(self) -> common_pb2.WorkerLoad:
        s = self.monitor.snapshot()
        total = self.total_kv_blocks
        kv = self.kv_transfers()
        return common_pb2.WorkerLoad(
            queue_len=self.inflight, running=s.num_running, waiting=s.num_waiting,
            free_kv_blocks=round(total * (1.0 - s.kv_cache_usage)), total_kv_blocks=total,
            held_kv_blocks=kv.get("held_blocks", 0),
            held_kv_transfers=kv.get("held", 0) + kv.get("claimed", 0))

    async def stats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.StatsResponse:
        s = self.monitor.snapshot()
        return worker_pb2.StatsResponse(
            load=self.load(), role=self.cfg.role.to_proto(), model=self.served_model,
            engine_id=self.cfg.engine.engine_id or "", kv_address=self.kv_address,
            kv_transfers={k: v for k, v in self.kv_transfers().items() if k != "held_blocks"},
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            kv_cache_dtype=self.cfg.engine.kv_cache_dtype, kv_pulls=s.transfers.transfers,
            kv_pulled_bytes=s.transfers.bytes, spec_draft_tokens=s.spec_draft_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens)


@contextlib.asynccontextmanager
async def rpc_errors(context: grpc.aio.ServicerContext, request_id: str):
    """Map failures to status codes: bad input → INVALID_ARGUMENT, not ready → UNAVAILABLE."""
    try:
        yield
    except Unavailable as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except PermissionDenied as e:
        log.warning("request %s refused: %s", request_id, e)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
    except ValueError as e:
        log.info("request %s rejected: %s", request_id, e)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
