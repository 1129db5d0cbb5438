"""A worker's side of the router registry: register, heartbeat with load, re-register, leave.

The router forgets a worker that misses heartbeats; when the worker (or the router) comes back,
the next heartbeat answers "unknown" and the worker registers again, so neither side has to be
started first and either can restart.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.credentials import with_token
from splitserve.tls import aio_channel
from splitserve.v1 import registry_pb2, registry_pb2_grpc
from splitserve.worker.core import WorkerCore

log = logging.getLogger(__name__)


async def heartbeat_loop(core: WorkerCore, router: str, worker_id: str, address: str,
                         stop: asyncio.Event) -> None:
    cfg = core.cfg
    register = registry_pb2.RegisterRequest(
        worker_id=worker_id, role=cfg.role.to_proto(), grpc_address=address,
        model=core.served_model, engine_id=cfg.engine.engine_id or "", kv_address=core.kv_address,
        capacity=registry_pb2.WorkerCapacity(
            max_num_seqs=cfg.engine.max_num_seqs, total_kv_blocks=core.total_kv_blocks,
            block_size=cfg.engine.block_size, max_model_len=cfg.engine.max_model_len))
    interval = cfg.heartbeat_interval_s
    registered = False
    warned = False
    async with aio_channel(router, cfg.tls) as channel:
        stub = with_token(registry_pb2_grpc.RegistryStub(channel), cfg.cluster_token)
        while not stop.is_set():
            try:
                if not registered:
                    resp = await stub.Register(register, timeout=interval * 2)
                    interval = resp.heartbeat_interval_s or interval
                    registered = True
                    log.info("registered with router %s as %s", router, worker_id)
                else:
                    beat = await stub.Heartbeat(registry_pb2.HeartbeatRequest(
                        worker_id=worker_id, load=core.load()), timeout=interval * 2)
                    registered = beat.known  # the router restarted or dropped us: re-register
                warned = False
            except grpc.aio.AioRpcError as e:
                registered = False
                if not warned:  # one line per outage, not one per beat
                    log.warning("router %s refused or unreachable (%s: %s); retrying", router,
                                e.code().name, e.details())
                    warned = True
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
        try:
            await stub.Deregister(registry_pb2.DeregisterRequest(worker_id=worker_id), timeout=2)
        except grpc.aio.AioRpcError:
            pass  # the router will drop us after missed heartbeats anyway
