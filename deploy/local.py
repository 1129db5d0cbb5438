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

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from deploy.local_security import LocalSecurity
from deploy.placement import pin_serving
from deploy.procs import Proc, ProcessSet
from deploy.progress import LogWatch
from splitserve.credentials import bearer
from splitserve.roles import Role
from splitserve.settings import setting
from splitserve.tls import TLSConfig, sync_channel
from splitserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class UpConfig:
    # A model directory, resolved once: the workers must not race to fetch it.
    model: str = setting(internal=True)
    n_prefill: int = setting(1, "prefill workers", flag="--prefill")
    n_decode: int = setting(1, "decode workers", flag="--decode")
    n_colocated: int = setting(0, "colocated (prefill+decode) workers", flag="--colocated")
    # The serving processes (router, worker servers) share the cores the engines leave free
    # (deploy/placement.py).
    pin_serving: bool = setting(
        True, "keep the router and worker servers on the cores the engines leave free")
    start_timeout_s: float = setting(600.0, "how long the engines may take to load")
    grpc_port: int = setting(50051, internal=True)  # the router's --grpc-port
    engine_args: tuple[str, ...] = setting((), internal=True)  # passed on to every worker
    router_args: tuple[str, ...] = setting((), internal=True)
    log_dir: Path | None = setting(None, internal=True)  # None: children write to our console
    log_level: str = setting("INFO", internal=True)  # the components' own logging
    extra_env: dict[str, str] = setting(factory=dict, internal=True)  # every child's, over all
    # The cluster's credentials (deploy/local_security.py), given to each child in its
    # environment; the Registry gets a port of its own (mutual TLS with `--tls`).
    secure: LocalSecurity | None = setting(None, internal=True)
    ready_file: str | None = setting(None, internal=True)  # where everything is, once ready
    api_key: str | None = setting(None, internal=True)  # what our own calls present


def say(msg: str) -> None:
    print(f"[splitserve] {msg}", file=sys.stderr, flush=True)


def wait_workers(address: str, want_prefill: int, want_decode: int, cluster: ProcessSet,
                 timeout_s: float, started: float, tls: TLSConfig | None = None,
                 api_key: str | None = None) -> None:
    """Until the router sees every worker; a line for each worker as its engine is ready."""
    deadline = time.monotonic() + timeout_s
    pending: list[Proc] = [p for p in cluster.procs if p.role is not None]
    # With logs in files, a line as each engine enters a phase (compiling takes a while); on
    # the console (`--verbose`) vLLM's own lines say it.
    watches = ({p.name: LogWatch(cluster.log_dir / f"{p.name}.log") for p in pending}
               if cluster.log_dir else {})
    with sync_channel(address, tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            if cluster.dead():
                raise RuntimeError(f"exited during start-up: {', '.join(cluster.dead())}"
                                   + cluster.tails())
            for p in pending:
                if p.name in watches and (now := watches[p.name].changed()):
                    say(f"{p.name}: {now}")
            for p in [p for p in pending if p.ready_file.exists() and p.ready_file.read_text()]:
                say(f"{p.name} ready in {time.monotonic() - started:.0f} s")
                pending.remove(p)
            try:
                (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=2,
                                       metadata=bearer(api_key)).models
                if not pending and (m.prefill_workers, m.decode_workers) >= (want_prefill,
                                                                              want_decode):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    where = f" (logs: {cluster.log_dir})" if cluster.log_dir else ""
    raise TimeoutError(f"workers did not all register within {timeout_s:.0f} s{where}")


def up(cfg: UpConfig, run_until: Callable[[str, TLSConfig | None], bool] | None = None,
       cores=None) -> int:
    """Start everything, wait until ready, block until a signal (or `run_until(address, tls)`
    is true)."""
    if cfg.n_decode + cfg.n_colocated == 0:
        raise ValueError("a cluster needs at least one decode or colocated worker")
    if cfg.n_prefill and not cfg.n_decode:
        raise ValueError("prefill workers need decode workers to hand their KV to")
    if cfg.log_dir is not None:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = ProcessSet(log_dir=cfg.log_dir)
    if cores is None:
        from splitserve.engine import spread_cores as cores  # one core per engine, round-robin
    secure = cfg.secure
    level = ["--log-level", cfg.log_level]
    sec_args = secure.args() if secure else []

    def env(router: bool) -> dict[str, str] | None:
        if secure is None and not cfg.extra_env:
            return None
        return {**(secure.env(router=router) if secure else os.environ), **cfg.extra_env}

    def on_signal(signum, frame):
        raise KeyboardInterrupt  # unwinds any wait below into the cleanup in `finally`

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.monotonic()
        if cfg.log_dir is not None:
            say(f"logs: {cfg.log_dir}/ (router.log and one per worker)")
        router = cluster.spawn("router", [*level, "router", "--model", cfg.model, "--grpc-port",
                                          str(cfg.grpc_port), "--cluster-port", "0", *sec_args,
                                          *cfg.router_args], env=env(router=True))
        cluster.wait_ready([router], 60)
        endpoints, address = router.endpoints, router.address
        tls = secure.tls if secure else None
        roles = ([Role.PREFILL] * cfg.n_prefill + [Role.DECODE] * cfg.n_decode
                 + [Role.COLOCATED] * cfg.n_colocated)
        names = []
        for i, role in enumerate(roles):
            name = f"{role}-{i}"
            cluster.spawn(name, [*level, role.value, "--model", cfg.model, "--router",
                                 endpoints["cluster"], "--worker-id", name, *cfg.engine_args,
                                 *sec_args, "--cpu-cores", cores(i)], role,
                          env=env(router=False))
            names.append(f"{name} (core {cores(i)})")
        say(f"router on {address}; loading {', '.join(names)} ...")
        wait_workers(address, cfg.n_prefill, cfg.n_decode + cfg.n_colocated, cluster,
                     cfg.start_timeout_s, t0, tls, cfg.api_key)
        pinned = pin_serving([p.popen.pid for p in cluster.procs],
                             [cores(i) for i in range(len(roles))]) if cfg.pin_serving else set()
        if pinned and cfg.log_dir is None:  # a detail for those who asked for details
            say(f"router and worker servers pinned to core(s) "
                f"{','.join(map(str, sorted(pinned)))}; engines keep their own")
        http = endpoints.get("http")
        say(f"ready in {time.monotonic() - t0:.0f} s. gRPC: {address}"
            + (f"  OpenAI API: {http}/v1  metrics: {http}/metrics" if http else ""))
        if cfg.ready_file:  # tests: where everything is
            cluster.wait_ready(timeout_s=60)  # registered, so ready: this reads their endpoints
            Path(cfg.ready_file).write_text(json.dumps({
                "router": endpoints, "workers": {p.name: p.endpoints for p in cluster.procs
                                                 if p.role is not None},
                "tls": None if tls is None else {"cert": tls.cert, "key": tls.key,
                                                 "ca": tls.ca}}))
        if run_until is None:
            say(f"try: splitserve chat --router {address}"
                + (f" --tls-ca {tls.ca}" if tls else "") + "   (Ctrl-C here stops the cluster)")
            print(address, flush=True)  # stdout: the one thing scripts need
        while True:
            if run_until is not None and run_until(address, tls):
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
        if secure is not None:
            secure.cleanup()
        say(f"stopped in {time.monotonic() - t_stop:.0f} s")
        for s, h in old.items():
            signal.signal(s, h)
