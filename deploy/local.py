"""`splitserve up`: a whole cluster on this host — router + prefill, decode and colocated workers.

Lifecycle: router process (ready file) → worker processes, each registering with the router →
one progress line per component as it becomes ready → "ready" with the addresses to use → on
Ctrl-C / SIGTERM the workers drain and stop, then the router; anything still alive after the grace
period is killed with its whole process group (vLLM engines have children of their own), so
nothing is left behind.

The console carries only our own lines (stderr) and the answers (stdout). Every component's
output — its engine's included — goes to a log file of its own in `log_dir`, whose path is
printed first; with `log_dir=None` (`up --verbose`) it all goes to the console instead.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from deploy.placement import pin_serving
from deploy.procs import Proc, ProcessSet
from splitserve.roles import Role
from splitserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class UpConfig:
    model: str  # a model directory (resolved: the workers must not race to fetch it)
    n_prefill: int = 1
    n_decode: int = 1
    n_colocated: int = 0
    grpc_port: int = 50051
    engine_args: tuple[str, ...] = ()  # passed on to every worker
    router_args: tuple[str, ...] = ()
    log_dir: Path | None = None  # None: children write to our console
    log_level: str = "INFO"  # the components' own logging
    env: dict[str, str] | None = None  # the children's environment (None: ours)
    start_timeout_s: float = 600.0


def say(msg: str) -> None:
    print(f"[splitserve] {msg}", file=sys.stderr, flush=True)


def wait_workers(address: str, want_prefill: int, want_decode: int, cluster: ProcessSet,
                 timeout_s: float, started: float) -> None:
    """Until the router sees every worker; a line for each worker as its engine is ready."""
    deadline = time.monotonic() + timeout_s
    pending: list[Proc] = [p for p in cluster.procs if p.role is not None]
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            if cluster.dead():
                raise RuntimeError(f"exited during start-up: {', '.join(cluster.dead())}"
                                   + cluster.tails())
            for p in [p for p in pending if p.ready_file.exists() and p.ready_file.read_text()]:
                say(f"{p.name} ready in {time.monotonic() - started:.0f} s")
                pending.remove(p)
            try:
                (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=2).models
                if not pending and (m.prefill_workers, m.decode_workers) >= (want_prefill,
                                                                              want_decode):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    where = f" (logs: {cluster.log_dir})" if cluster.log_dir else ""
    raise TimeoutError(f"workers did not all register within {timeout_s:.0f} s{where}")


def up(cfg: UpConfig, run_until: Callable[[str], bool] | None = None, cores=None) -> int:
    """Start everything, wait until ready, block until a signal (or `run_until(address)` is
    true)."""
    if cfg.n_decode + cfg.n_colocated == 0:
        raise ValueError("a cluster needs at least one decode or colocated worker")
    if cfg.n_prefill and not cfg.n_decode:
        raise ValueError("prefill workers need decode workers to hand their KV to")
    if cfg.log_dir is not None:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = ProcessSet(log_dir=cfg.log_dir, env=cfg.env)
    level = ["--log-level", cfg.log_level]
    if cores is None:
        from splitserve.engine import spread_cores as cores  # one core per engine, round-robin

    def on_signal(signum, frame):
        raise KeyboardInterrupt  # unwinds any wait below into the cleanup in `finally`

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.monotonic()
        if cfg.log_dir is not None:
            say(f"logs: {cfg.log_dir}/ (router.log and one per worker)")
        router = cluster.spawn("router", [*level, "router", "--model", cfg.model, "--grpc-port",
                                          str(cfg.grpc_port), *cfg.router_args])
        cluster.wait_ready([router], 60)
        endpoints, address = router.endpoints, router.address
        roles = ([Role.PREFILL] * cfg.n_prefill + [Role.DECODE] * cfg.n_decode
                 + [Role.COLOCATED] * cfg.n_colocated)
        names = []
        for i, role in enumerate(roles):
            name = f"{role}-{i}"
            cluster.spawn(name, [*level, role.value, "--model", cfg.model, "--router", address,
                                 "--worker-id", name, *cfg.engine_args, "--cpu-cores",
                                 cores(i)], role)
            names.append(f"{name} (core {cores(i)})")
        say(f"router on {address}; loading {', '.join(names)} ...")
        wait_workers(address, cfg.n_prefill, cfg.n_decode + cfg.n_colocated, cluster,
                     cfg.start_timeout_s, t0)
        pinned = pin_serving([p.popen.pid for p in cluster.procs],
                             [cores(i) for i in range(len(roles))])
        if pinned and cfg.log_dir is None:  # a detail for those who asked for details
            say(f"router and worker servers pinned to core(s) "
                f"{','.join(map(str, sorted(pinned)))}; engines keep their own")
        http = endpoints.get("http")
        say(f"ready in {time.monotonic() - t0:.0f} s. gRPC: {address}"
            + (f"  OpenAI API: {http}/v1  metrics: {http}/metrics" if http else ""))
        if run_until is None:
            say(f"try: splitserve chat --router {address}   (Ctrl-C here stops the cluster)")
            print(address, flush=True)  # stdout: the one thing scripts need
        while True:
            if run_until is not None and run_until(address):
                break
            if cluster.dead():
                say(f"exited unexpectedly: {', '.join(cluster.dead())}" + cluster.tails())
                return 1
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        say("stopping ...")
        t_stop = time.monotonic()
        cluster.stop()
        say(f"stopped in {time.monotonic() - t_stop:.0f} s")
        for s, h in old.items():
            signal.signal(s, h)
