"""Run one worker process: gRPC server, engine, registration, graceful drain.

Order matters for operators: the gRPC port (with health NOT_SERVING) is up before the engine
starts loading, so probes and the router see a live-but-not-ready worker instead of a refused
connection; the worker registers only once it can serve; SIGTERM drains before it exits.

The role's own service comes from above (`AddServicer`, given by the composition layer), so this
lifecycle knows no role package.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.credentials import Access
from splitserve.engine import build_engine, concrete_dtype, stop_engine
from splitserve.health import set_serving
from splitserve.roles import Role
from splitserve.tls import add_port
from splitserve.worker.config import WorkerConfig
from splitserve.worker.core import Phase, WorkerCore
from splitserve.worker.registration import heartbeat_loop

log = logging.getLogger(__name__)

# Adds the role's servicer to the server; returns the full names of the services it added.
AddServicer = Callable[[WorkerCore, grpc.aio.Server], list[str]]


async def serve(cfg: WorkerConfig, add_servicer: AddServicer,
                ready_file: str | None = None) -> None:
    served = cfg.model_name or Path(cfg.engine.model).name
    engine_cfg = cfg.engine
    if engine_cfg.engine_id is None:
        engine_cfg = replace(engine_cfg, engine_id=f"{cfg.role}-{uuid.uuid4().hex[:8]}")
    dtype, why = concrete_dtype(engine_cfg.dtype, model_dir=engine_cfg.model)
    if engine_cfg.dtype == "auto":
        _progress(f"{cfg.role} worker {engine_cfg.engine_id}: dtype {dtype} ({why})")
        engine_cfg = replace(engine_cfg, dtype=dtype)
    board = None
    if cfg.role is Role.PREFILL and engine_cfg.kv_settings.status_file is None:
        # Where the producer publishes what it holds (splitserve/kv/board.py); ours to remove.
        board = Path(tempfile.gettempdir()) / f"splitserve-{engine_cfg.engine_id}.kvboard"
        engine_cfg = replace(engine_cfg, kv_settings=replace(engine_cfg.kv_settings,
                                                             status_file=str(board)))
    try:
        await _serve(replace(cfg, engine=engine_cfg), served, add_servicer, ready_file)
    finally:
        if board is not None:
            board.unlink(missing_ok=True)


async def _serve(cfg: WorkerConfig, served: str, add_servicer: AddServicer,
                 ready_file: str | None) -> None:
    engine_cfg = cfg.engine
    core = WorkerCore(cfg, served)
    server, port, names, health_servicer = build_server(cfg, core, add_servicer)
    address = f"{cfg.advertise_host or cfg.host}:{port}"
    await set_serving(health_servicer, names, False)
    await server.start()
    endpoints = {"grpc": address}
    if cfg.metrics_port is not None:
        from splitserve.worker.metrics import start_metrics

        mport = start_metrics(core, cfg.host, cfg.metrics_port, cfg.tls)
        scheme = "https" if cfg.tls else "http"
        endpoints["metrics"] = f"{scheme}://{cfg.advertise_host or cfg.host}:{mport}/metrics"
    _progress(f"{cfg.role} worker {engine_cfg.engine_id}: gRPC on {address}"
              + (f", metrics on {endpoints['metrics']}" if "metrics" in endpoints else "")
              + ", loading the engine")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    t0 = time.monotonic()
    # Building the engine blocks for seconds (it waits for the engine-core process); keep the
    # event loop free so health checks are answered meanwhile.
    load = asyncio.ensure_future(asyncio.to_thread(build_engine, engine_cfg, core.monitor))
    await asyncio.wait([load, asyncio.ensure_future(stop.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # asked to stop while loading
        engine = await load
        stop_engine(engine)
        await server.stop(0)
        return
    core.engine = engine = load.result()
    core.total_kv_blocks = int(engine.vllm_config.cache_config.num_gpu_blocks or 0)
    if cfg.role is Role.PREFILL:  # registered, so the router can vouch for our tickets
        from splitserve.kv.control import kv_endpoint

        core.kv_address = await kv_endpoint(engine)
    core.phase = Phase.SERVING
    await set_serving(health_servicer, names, True)
    _progress(f"{cfg.role} worker {engine_cfg.engine_id}: ready in {time.monotonic() - t0:.1f} s "
              f"({core.total_kv_blocks} KV blocks)")
    if ready_file:
        Path(ready_file).write_text(json.dumps(endpoints))

    beats = None
    if cfg.router:
        worker_id = cfg.worker_id or engine_cfg.engine_id
        beats = asyncio.ensure_future(heartbeat_loop(core, cfg.router, worker_id, address, stop))
    await stop.wait()

    # Drain: stop taking work, let what is running finish (bounded), then go.
    core.phase = Phase.DRAINING
    await set_serving(health_servicer, names, False)
    _progress(f"{cfg.role} worker {engine_cfg.engine_id}: draining {core.inflight} request(s)")
    if beats is not None:
        await beats
    deadline = time.monotonic() + cfg.drain_timeout_s
    while core.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)
    stop_engine(engine)
    _progress(f"{cfg.role} worker {engine_cfg.engine_id}: stopped")


def build_server(cfg: WorkerConfig, core: WorkerCore, add_servicer: AddServicer
                 ) -> tuple[grpc.aio.Server, int, list[str], health.aio.HealthServicer]:
    """The worker's gRPC server, bound (not started): the role's service behind the cluster
    credential, health and reflection open; TLS — mutual when there is a CA — when configured.
    """
    interceptor = Access(cluster_token=cfg.cluster_token).interceptor()
    server = grpc.aio.server(interceptors=[interceptor] if interceptor else [])
    names = add_servicer(core, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)
    port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls,
                    client_auth=cfg.tls is not None and cfg.tls.ca is not None)
    return server, port, names, health_servicer


def _progress(msg: str) -> None:
    """One line per lifecycle step on stderr: what `splitserve up` shows while engines load."""
    print(f"[splitserve] {msg}", file=sys.stderr, flush=True)
    log.info(msg)
