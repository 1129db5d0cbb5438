"""`splitserve up`: a whole cluster on this host — router + prefill, decode and colocated workers.

Lifecycle: router process (ready file) → worker processes, each registering with the router →
progress lines while engines load → "ready" with the address to use → on Ctrl-C / SIGTERM the
workers drain and stop, then the router; anything still alive after the grace period is killed
with its whole process group (vLLM engines have children of their own), so nothing is left behind.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import grpc

from deploy.local_security import LocalSecurity
from deploy.placement import pin_serving
from deploy.procs import ProcessSet
from splitserve.credentials import bearer
from splitserve.roles import Role
from splitserve.tls import TLSConfig, sync_channel
from splitserve.v1 import generation_pb2, generation_pb2_grpc


def wait_workers(address: str, want_prefill: int, want_decode: int, cluster: ProcessSet,
                 timeout_s: float, tls: TLSConfig | None = None,
                 api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    with sync_channel(address, tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            if cluster.dead():
                raise RuntimeError(f"process exited during start-up: {', '.join(cluster.dead())}")
            try:
                (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=2,
                                       metadata=bearer(api_key)).models
                if m.prefill_workers >= want_prefill and m.decode_workers >= want_decode:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"workers did not all register within {timeout_s:.0f} s")


def up(model: str, n_prefill: int, n_decode: int, n_colocated: int, grpc_port: int,
       engine_args: list[str], router_args: list[str], start_timeout_s: float = 600.0,
       run_until=None, cores=None, secure: LocalSecurity | None = None,
       ready_file: str | None = None, api_key: str | None = None) -> int:
    """Start everything, wait until ready, block until a signal (or `run_until()` returns).
    `secure`: the cluster's credentials (deploy/local_security.py), given to each child in its
    environment; the Registry gets a port of its own (mutual TLS with `--tls`)."""
    if n_decode + n_colocated == 0:
        raise ValueError("a cluster needs at least one decode or colocated worker")
    if n_prefill and not n_decode:
        raise ValueError("prefill workers need decode workers to hand their KV to")
    cluster = ProcessSet()
    if cores is None:
        from splitserve.engine import spread_cores as cores  # one core per engine, round-robin

    def on_signal(signum, frame):
        raise KeyboardInterrupt  # unwinds any wait below into the cleanup in `finally`

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.monotonic()
        sec_args = secure.args() if secure else []
        router = cluster.spawn("router", ["router", "--model", model, "--grpc-port",
                                          str(grpc_port), "--cluster-port", "0", *sec_args,
                                          *router_args],
                               env=secure.env(router=True) if secure else None)
        cluster.wait_ready([router], 60)
        endpoints, address = router.endpoints, router.address
        tls = secure.tls if secure else None
        roles = ([Role.PREFILL] * n_prefill + [Role.DECODE] * n_decode
                 + [Role.COLOCATED] * n_colocated)
        for i, role in enumerate(roles):
            cluster.spawn(f"{role}-{i}", [role.value, "--model", model, "--router",
                                          endpoints["cluster"], "--worker-id", f"{role}-{i}",
                                          *engine_args, *sec_args, "--cpu-cores", cores(i)],
                          role, env=secure.env(router=False) if secure else None)
        print(f"[splitserve] up: router on {address}; starting {len(roles)} worker(s) "
              f"({n_prefill} prefill, {n_decode} decode, {n_colocated} colocated)",
              file=sys.stderr, flush=True)
        wait_workers(address, n_prefill, n_decode + n_colocated, cluster, start_timeout_s, tls,
                     api_key)
        pinned = pin_serving([p.popen.pid for p in cluster.procs],
                             [cores(i) for i in range(len(roles))])
        if pinned:
            print(f"[splitserve] router and worker servers pinned to core(s) "
                  f"{','.join(map(str, sorted(pinned)))}; engines keep their own",
                  file=sys.stderr, flush=True)
        http = endpoints.get("http")
        print(f"[splitserve] ready in {time.monotonic() - t0:.0f} s. gRPC: {address}"
              + (f"  HTTP (OpenAI API): {http}/v1  metrics: {http}/metrics" if http else "")
              + "\n"
              f"[splitserve] try: splitserve generate \"Hello\" --router {address}"
              + (f" --tls-ca {tls.ca}" if tls else ""),
              file=sys.stderr, flush=True)
        if ready_file:  # tests: where everything is
            cluster.wait_ready(timeout_s=60)  # registered, so ready: this reads their endpoints
            Path(ready_file).write_text(json.dumps({
                "router": endpoints, "workers": {p.name: p.endpoints for p in cluster.procs
                                                 if p.role is not None},
                "tls": None if tls is None else {"cert": tls.cert, "key": tls.key,
                                                 "ca": tls.ca}}))
        if run_until is None:
            print(address, flush=True)  # stdout: the one thing scripts need
        while True:
            if run_until is not None and run_until(address, tls):
                break
            if cluster.dead():
                print(f"[splitserve] exited unexpectedly: {', '.join(cluster.dead())}",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        print("[splitserve] stopping ...", file=sys.stderr, flush=True)
        cluster.stop()
        if secure is not None:
            secure.cleanup()
        for s, h in old.items():
            signal.signal(s, h)
