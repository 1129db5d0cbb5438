"""Real processes for end-to-end tests: routers and workers started through the CLI.

Each process runs in its own session so that stopping it takes its vLLM engine processes along;
`close()` asserts nothing survived.
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

from router.registry import worker_stub
from splitserve.v1 import generation_pb2_grpc, worker_pb2

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    address: str = ""
    role: str = ""
    endpoints: dict = field(default_factory=dict)

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(10)


class ProcCluster:
    def __init__(self, model_dir: Path) -> None:
        self.model = str(model_dir)
        self.tmp = Path(tempfile.mkdtemp(prefix="splitserve-e2e-"))
        self.procs: list[Proc] = []
        self._channels: list[grpc.Channel] = []

    def _spawn(self, name: str, args: list[str]) -> Proc:
        ready = self.tmp / name
        log = open(self.tmp / f"{name}.log", "w")
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
        p = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "--log-level", "INFO",
                              *args, "--ready-file", str(ready)], cwd=ROOT, env=env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, p)
        self.procs.append(proc)
        return proc

    def router(self, name: str, *args: str) -> Proc:
        return self._spawn(name, ["router", "--model", self.model, "--grpc-port", "0",
                                  "--http-port", "0", *args])

    def worker(self, name: str, role: str, core: int, *args: str) -> Proc:
        p = self._spawn(name, [role, "--model", self.model, "--dtype", "float32",
                               "--kv-cache-mib", "128", "--cpu-cores", str(core),
                               "--kv-timeout-s", "5", *args])
        p.role = role
        return p

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            f = self.tmp / p.name
            while not (f.exists() and f.read_text()):
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited: {self.log(p.name)[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{p.name} not ready: {self.log(p.name)[-3000:]}")
                time.sleep(0.2)
            p.endpoints = json.loads(f.read_text())
            p.address = p.endpoints["grpc"]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def generation(self, router: Proc) -> generation_pb2_grpc.GenerationStub:
        ch = grpc.insecure_channel(router.address)
        self._channels.append(ch)
        return generation_pb2_grpc.GenerationStub(ch)

    def worker_stats(self, p: Proc) -> worker_pb2.StatsResponse:
        with grpc.insecure_channel(p.address) as ch:
            return worker_stub(p.role, ch).Stats(worker_pb2.StatsRequest(), timeout=5)

    def assert_workers_idle(self, timeout_s: float = 30.0) -> None:
        """The leak check: every live worker has nothing running, every KV block free, and no
        KV held under a lease (a prefill worker's copies included)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if not p.role or p.popen.poll() is not None:
                continue
            while True:
                load = self.worker_stats(p).load
                if (load.running == load.waiting == load.queue_len == 0
                        and load.free_kv_blocks == load.total_kv_blocks
                        and load.held_kv_blocks == 0):  # no KV held for a decode worker
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{p.name} not idle (leak?): {load}")
                time.sleep(0.1)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        for p in reversed(self.procs):  # workers first: they drain and deregister
            if p.popen.poll() is None:
                os.killpg(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            p.kill()
        # Every engine process started under these sessions must be gone (SIGKILLed children
        # take a moment to be reaped).
        for _ in range(50):
            survivors = [p.name for p in self.procs if _session_alive(p.popen.pid)]
            if not survivors:
                return
            time.sleep(0.1)
        raise AssertionError(f"processes left behind: {survivors}")


def _session_alive(sid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
                return True
    return False
