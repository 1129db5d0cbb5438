"""`splitserve up`: a whole cluster on this host — router + prefill, decode and colocated workers.

Lifecycle: router process (ready file) → worker processes, each registering with the router →
progress lines while engines load → "ready" with the address to use → on Ctrl-C / SIGTERM the
workers drain and stop, then the router; anything still alive after the grace period is killed
with its whole process group (vLLM engines have children of their own), so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitserve.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class Cluster:
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        # Own session per child: stopping it can take its engine processes along.
        p = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args],
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode})" for n, p in self.procs if p.poll() is not None]

    def stop(self, grace_s: float = 30.0) -> None:
        # Workers first (they deregister and drain), the router last.
        for group in (self.procs[1:], self.procs[:1]):
            for _, p in group:
                if p.poll() is None:
                    _signal(p, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for _, p in group:
                try:
                    p.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        for _, p in self.procs:  # whatever is left, and the engine children of everyone
            _signal(p, signal.SIGKILL)
            p.wait()


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_file(path: Path, cluster: Cluster, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if cluster.dead():
            raise RuntimeError(f"process exited during start-up: {', '.join(cluster.dead())}")
        time.sleep(0.1)
    raise TimeoutError(f"{path.name} not ready after {timeout_s:.0f} s")


def wait_workers(address: str, want_prefill: int, want_decode: int, cluster: Cluster,
                 timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            if cluster.dead():
                raise RuntimeError(f"process exited during start-up: {', '.join(cluster.dead())}")
            try:
                (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=2).models
                if m.prefill_workers >= want_prefill and m.decode_workers >= want_decode:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"workers did not all register within {timeout_s:.0f} s")


def up(model: str, n_prefill: int, n_decode: int, n_colocated: int, grpc_port: int,
       engine_args: list[str], router_args: list[str], start_timeout_s: float = 600.0,
       run_until=None, cores=None) -> int:
    """Start everything, wait until ready, block until a signal (or `run_until()` returns)."""
    if n_decode + n_colocated == 0:
        raise ValueError("a cluster needs at least one decode or colocated worker")
    if n_prefill and not n_decode:
        raise ValueError("prefill workers need decode workers to hand their KV to")
    cluster = Cluster()
    if cores is None:
        from splitserve.engine import spread_cores as cores  # one core per engine, round-robin

    def on_signal(signum, frame):
        raise KeyboardInterrupt  # unwinds any wait below into the cleanup in `finally`

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    tmp = Path(tempfile.mkdtemp(prefix="splitserve-up-"))
    try:
        t0 = time.monotonic()
        cluster.spawn("router", ["router", "--model", model, "--grpc-port", str(grpc_port),
                                 "--ready-file", str(tmp / "router"), *router_args])
        endpoints = json.loads(wait_file(tmp / "router", cluster, 60))
        address = endpoints["grpc"]
        roles = ["prefill"] * n_prefill + ["decode"] * n_decode + ["colocated"] * n_colocated
        for i, role in enumerate(roles):
            cluster.spawn(f"{role}-{i}", [role, "--model", model, "--router", address,
                                          "--worker-id", f"{role}-{i}", *engine_args,
                                          "--cpu-cores", cores(i)])
        print(f"[splitserve] up: router on {address}; starting {len(roles)} worker(s) "
              f"({n_prefill} prefill, {n_decode} decode, {n_colocated} colocated)",
              file=sys.stderr, flush=True)
        wait_workers(address, n_prefill, n_decode + n_colocated, cluster, start_timeout_s)
        http = endpoints.get("http")
        print(f"[splitserve] ready in {time.monotonic() - t0:.0f} s. gRPC: {address}"
              + (f"  HTTP (OpenAI API): {http}/v1  metrics: {http}/metrics" if http else "")
              + "\n"
              f"[splitserve] try: splitserve generate \"Hello\" --router {address}",
              file=sys.stderr, flush=True)
        if run_until is None:
            print(address, flush=True)  # stdout: the one thing scripts need
        while True:
            if run_until is not None and run_until(address):
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
        for s, h in old.items():
            signal.signal(s, h)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
