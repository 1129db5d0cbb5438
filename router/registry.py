"""The router's view of its workers: who is alive, in which role, how loaded.

Lifecycle of a worker here: Register → (Heartbeat with load)* → dropped when heartbeats stop for
`heartbeat_timeout_s` (or on Deregister) → a later heartbeat is answered `known=False`, so the
worker registers again and is taken back. Static workers (given by address at start-up) are
polled with Stats instead and dropped/taken back by the same rule.

Each worker gets one long-lived gRPC channel; `inflight` counts the router's own requests on it,
which is fresher than the worker's last heartbeat when a burst arrives. A worker that leaves stops
getting new requests at once, but its channel stays open until the requests already on it end:
one that only missed heartbeats (a busy host) finishes them, a dead one fails them by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from router.session import DecodeSession
from router.vouch import VouchingPrefill
from splitserve.credentials import with_token
from splitserve.roles import Role
from splitserve.tls import TLSConfig, aio_channel
from splitserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 600.0  # longest a departed worker's channel stays open for requests on it
# What the router receives from a worker is small (token batches, prefill replies; the KV goes
# over the pair channel), so its channels keep HTTP/2's fixed 64 KiB window instead of letting
# gRPC's bandwidth probe grow it to megabytes. A router that falls behind then holds its workers
# back, and a worker's session batches what piled up into fewer, larger messages (decode_worker/
# session.py); with the window grown, the worker sent thousands of tiny messages ahead and the
# router spent its core reading them one by one. bench/router_throughput.py measures it at 32
# streams (docs/benchmarks-log.md, "Router overhead", the fixed flow-control window).
WORKER_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0)]


def worker_stub(role: Role, channel: grpc.aio.Channel | grpc.Channel):
    """The internal service a worker of `role` serves (colocated workers serve DecodeWorker)."""
    return (worker_pb2_grpc.DecodeWorkerStub(channel) if role.decodes
            else worker_pb2_grpc.PrefillWorkerStub(channel))


@dataclass(slots=True)
class Worker:
    worker_id: str
    role: Role
    address: str
    model: str
    capacity: registry_pb2.WorkerCapacity
    channel: grpc.aio.Channel
    stub: object  # PrefillWorkerStub or DecodeWorkerStub
    session: DecodeSession | None  # decode-capable workers: the stream all decodes share
    last_seen: float
    load: common_pb2.WorkerLoad = field(default_factory=common_pb2.WorkerLoad)
    inflight: int = 0
    inflight_tokens: int = 0  # prompt tokens of our prefills in flight on it (router/policy.py)
    static: bool = False


class WorkerRegistry(registry_pb2_grpc.RegistryServicer):
    def __init__(self, heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 10.0,
                 tls: TLSConfig | None = None, cluster_token: str | None = None,
                 ticket_key: bytes | None = None):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # How we reach workers: their TLS and their credential (their RPCs want it).
        self._tls, self._token, self._ticket_key = tls, cluster_token, ticket_key
        self._workers: dict[str, Worker] = {}
        self._static: list[tuple[Role, str]] = []
        self._retiring: set[asyncio.Task] = set()

    # -- queries ---------------------------------------------------------------------------
    def alive(self, role: Role, model: str | None = None) -> list[Worker]:
        cutoff = time.monotonic() - self.heartbeat_timeout_s
        return [w for w in self._workers.values()
                if w.role is role and w.last_seen >= cutoff and (model is None or w.model == model)]

    # -- Registry service --------------------------------------------------------------------
    async def Register(self, request: registry_pb2.RegisterRequest, context):
        try:
            role = Role.from_proto(request.role)
        except ValueError:
            role = None
        if role is None or not request.grpc_address or not request.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "worker_id, a known role and grpc_address are required")
        self._add(request.worker_id, role, request.grpc_address, request.model, request.capacity,
                  request.engine_id, request.kv_address)
        return registry_pb2.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context):
        w = self._workers.get(request.worker_id)
        if w is None:
            return registry_pb2.HeartbeatResponse(known=False,
                                                  heartbeat_interval_s=self.heartbeat_interval_s)
        w.last_seen = time.monotonic()
        w.load.CopyFrom(request.load)
        return registry_pb2.HeartbeatResponse(known=True,
                                              heartbeat_interval_s=self.heartbeat_interval_s)

    async def Deregister(self, request: registry_pb2.DeregisterRequest, context):
        return registry_pb2.DeregisterResponse(known=await self._remove(request.worker_id))

    # -- membership --------------------------------------------------------------------------
    def _add(self, worker_id: str, role: Role, address: str, model: str,
             capacity: registry_pb2.WorkerCapacity, engine_id: str = "", kv_address: str = "",
             static: bool = False) -> Worker:
        old = self._workers.get(worker_id)
        if old is not None and old.address == address and (
                old.role is not Role.PREFILL
                or (old.stub.engine_id, old.stub.kv_address) == (engine_id, kv_address)):
            old.last_seen = time.monotonic()
            return old
        if old is not None:
            self._retire(old)
        channel = aio_channel(address, self._tls, WORKER_CHANNEL_OPTIONS)
        stub = with_token(worker_stub(role, channel), self._token)
        if role is Role.PREFILL:  # its tickets pass on only if they name it (router/vouch.py)
            stub = VouchingPrefill(stub, engine_id, kv_address, self._ticket_key)
        w = Worker(worker_id, role, address, model, capacity, channel, stub,
                   DecodeSession(stub, worker_id) if role.decodes else None, time.monotonic(),
                   static=static)
        self._workers[worker_id] = w
        log.info("worker %s (%s) at %s joined", worker_id, role, address)
        return w

    async def _remove(self, worker_id: str) -> bool:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return False
        log.info("worker %s (%s) at %s left (%d request(s) still on it)", worker_id, w.role,
                 w.address, w.inflight)
        self._retire(w)
        return True

    def _retire(self, w: Worker) -> None:
        async def close_when_idle() -> None:
            deadline = time.monotonic() + RETIRE_GRACE_S
            while w.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            await w.channel.close()

        task = asyncio.ensure_future(close_when_idle())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def add_static(self, role: Role, address: str) -> None:
        """A worker known by address only (no registration): polled with Stats."""
        self._static.append((role, address))

    async def run(self, stop: asyncio.Event) -> None:
        """Poll static workers and drop silent ones, once per heartbeat interval."""
        while not stop.is_set():
            await asyncio.gather(*(self._poll_static(r, a) for r, a in self._static))
            cutoff = time.monotonic() - self.heartbeat_timeout_s
            for w in [w for w in self._workers.values() if w.last_seen < cutoff]:
                log.warning("worker %s at %s missed heartbeats for %.1f s: dropped",
                            w.worker_id, w.address, self.heartbeat_timeout_s)
                await self._remove(w.worker_id)
            try:
                await asyncio.wait_for(stop.wait(), self.heartbeat_interval_s)
            except asyncio.TimeoutError:
                pass
        for wid in list(self._workers):
            await self._remove(wid)
        if self._retiring:  # the server is draining its requests meanwhile; then they close
            await asyncio.wait(list(self._retiring), timeout=10.0)

    async def _poll_static(self, role: Role, address: str) -> None:
        wid = f"static-{role}-{address}"
        w = self._workers.get(wid)
        try:
            if w is None:
                async with aio_channel(address, self._tls) as ch:
                    stub = with_token(worker_stub(role, ch), self._token)
                    stats = await stub.Stats(worker_pb2.StatsRequest(),
                                             timeout=self.heartbeat_interval_s)
                w = self._add(wid, role, address, stats.model, registry_pb2.WorkerCapacity(),
                              stats.engine_id, stats.kv_address, static=True)
            else:
                stats = await w.stub.Stats(worker_pb2.StatsRequest(),
                                           timeout=self.heartbeat_interval_s)
                # A prefill worker restarted at the same address has a new engine and KV port.
                w = self._add(wid, role, address, stats.model, w.capacity, stats.engine_id,
                              stats.kv_address, static=True)
            w.last_seen = time.monotonic()
            w.load.CopyFrom(stats.load)
        except grpc.aio.AioRpcError:
            pass  # silent: the staleness rule drops it
