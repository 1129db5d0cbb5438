"""A worker container without an engine, for rollout simulations (tests/k8s/sim.py).

It takes a worker's exact command line (`prefill|decode|colocated ...`, parsed by the real
`splitserve` parser, with the real security checks), serves gRPC health (NOT_SERVING for a
moment, as while an engine loads, then SERVING), registers and heartbeats with the router
through the real registration code (splitserve/worker/registration.py), answers Decode like the
token-source stand-in (bench/token_source.py) and serves /metrics on the metrics port. What it
leaves out is the engine: the rollout's question is who can reach whom, and when.

    python -m tests.k8s.standin_worker decode --router HOST:PORT --host IP --port N ...
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from bench.token_source import TokenSource
from deploy import security_flags as sec
from deploy.cli import build_parser
from splitserve.engine import EngineConfig
from splitserve.health import set_serving
from splitserve.models import resolve_model
from splitserve.roles import Role
from splitserve.settings import parse_args
from splitserve.v1 import common_pb2, worker_pb2_grpc
from splitserve.worker.config import WorkerConfig
from splitserve.worker.registration import heartbeat_loop

LOAD_S = 1.0  # "engine loading": health says NOT_SERVING this long


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(b"splitserve:worker_serving 1\n")

    def log_message(self, *args) -> None:
        pass


async def serve(argv: list[str]) -> None:
    a = parse_args(build_parser(), argv)  # with its --config file, as the real worker
    role = Role(a.command)
    token = sec.cluster_token_of(a)
    sec.require_on_network(a.host, f"a {role} worker", token, "a cluster credential")
    if role.kv_role is not None:
        sec.require_on_network(a.kv_host, "a KV side channel", sec.kv_secret_of(a), "a KV secret")
    model = resolve_model(a.model)  # the served name is the model directory's, as for real
    served = a.model_name or Path(model).name
    cfg = WorkerConfig(role=role, engine=EngineConfig(model=model, max_model_len=a.max_model_len),
                       host=a.host, port=a.port, router=a.router, worker_id=a.worker_id,
                       cluster_token=token)
    server = grpc.aio.server()
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    if role.decodes:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
            TokenSource(0.0, 1, served), server)
    port = server.add_insecure_port(f"{a.host}:{a.port}")
    await set_serving(h, [], False)
    await server.start()
    if a.metrics_port is not None:
        http = ThreadingHTTPServer((a.host, a.metrics_port), _Metrics)
        threading.Thread(target=http.serve_forever, daemon=True).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await asyncio.sleep(LOAD_S)
    await set_serving(h, [], True)
    core = SimpleNamespace(cfg=cfg, served_model=served, kv_address="", total_kv_blocks=1024,
                           load=lambda: common_pb2.WorkerLoad(total_kv_blocks=1024,
                                                              free_kv_blocks=1024))
    address = f"{a.advertise_host or a.host}:{port}"
    if a.router:
        await heartbeat_loop(core, a.router, a.worker_id or f"{role}-{port}", address, stop)
    else:
        await stop.wait()
    await server.stop(0.5)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1:]))
