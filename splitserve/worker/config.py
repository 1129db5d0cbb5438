"""A worker's configuration: the one place each worker setting is written (its flags are made
from it, splitserve/settings.py). Light to import: every command's parser is built from it."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine import EngineConfig
from splitserve.roles import Role
from splitserve.settings import setting
from splitserve.tls import TLSConfig


@dataclass(frozen=True)
class WorkerConfig:
    role: Role = setting(internal=True)  # the command: prefill, decode or colocated
    engine: EngineConfig = setting(internal=True)  # flags of its own
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0: all)")
    port: int = setting(0, "gRPC port (0: any free port, printed and registered)")
    advertise_host: str | None = setting(
        None, "address the router should dial (default: --host); e.g. the pod IP")
    router: str | None = setting(
        None, "router address to register with (its --cluster-port if it has one); none: "
        "only a router that lists this worker as static uses it")
    # Required of every caller (the router) and sent to the router when registering; a decode
    # worker with it pulls KV only with tickets a router vouched for (router/vouch.py). From the
    # environment or a file (deploy/security_flags.py), never a flag.
    cluster_token: str | None = setting(None, internal=True, repr=False)
    tls: TLSConfig | None = setting(None, internal=True)  # server, metrics, channel to router
    worker_id: str | None = setting(None, "this worker's name at the router (default: a new "
                                          "one)")
    model_name: str | None = setting(
        None, "served model name (default: the model directory's name)")
    metrics_port: int | None = setting(0, "Prometheus /metrics port (0: any free port)")
    drain_timeout_s: float = setting(
        30.0, "on SIGTERM, how long running requests may take to finish")
    heartbeat_interval_s: float = setting(1.0, internal=True)
    uvloop: bool = setting(True, "run the event loop on uvloop where installed (off: asyncio's "
                                 "own)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
