"""One worker process: the role's gRPC servicer plugged into the shared worker lifecycle."""

from __future__ import annotations

from deploy.loop import run as run_loop
from splitserve.roles import Role
from splitserve.worker.config import WorkerConfig
from splitserve.worker.server import AddServicer, serve


def servicer_for(role: Role) -> AddServicer:
    """The role's service (colocated workers serve DecodeWorker and prefill locally)."""
    if role is Role.PREFILL:
        from prefill_worker.servicer import add_to_server
    else:
        from decode_worker.servicer import add_to_server
    return add_to_server


def run(cfg: WorkerConfig, ready_file: str | None = None) -> None:
    run_loop(serve(cfg, servicer_for(cfg.role), ready_file), cfg.uvloop)
