"""Real processes for end-to-end tests: routers and workers started through the CLI.

Built on the launcher `splitserve up` uses (deploy/procs.py); each process logs to a file the
failing test can show, and `close()` asserts nothing survived.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import grpc

from deploy.procs import Proc, ProcessSet
from router.registry import worker_stub
from splitserve import scrape
from splitserve.faults import Faults
from splitserve.kv import shm
from splitserve.roles import Role
from splitserve.v1 import generation_pb2_grpc, worker_pb2
from tests.utils import EAGER_FLAG

ROOT = Path(__file__).resolve().parents[2]


class ProcCluster(ProcessSet):
    def __init__(self, model_dir: Path) -> None:
        # VLLM_CPU_KVCACHE_SPACE as vLLM CPU users export it: every engine must still hold what
        # --kv-cache-mib says (test_serving's memory-plan test fails if the variable wins).
        super().__init__(log_dir=Path(tempfile.mkdtemp(prefix="splitserve-e2e-")),
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING",
                              "VLLM_CPU_KVCACHE_SPACE": "1"})
        self.model = str(model_dir)
        self.by_name: dict[str, Proc] = {}
        self._channels: list[grpc.Channel] = []

    def spawn(self, name: str, args: list[str], role: Role | None = None,
              env: dict[str, str] | None = None) -> Proc:
        p = super().spawn(name, ["--log-level", "INFO", *args], role, env=env)
        self.by_name[name] = p
        return p

    def router(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """`env`: more environment for this router (secrets: never on its command line)."""
        return self.spawn(name, ["router", "--model", self.model, "--grpc-port", "0",
                                 "--http-port", "0", *args],
                          env={**self.env, **env} if env else None)

    def worker(self, name: str, role: Role, core: int, *args: str,
               faults: Faults | None = None) -> Proc:
        """`faults`: test-only stalls for this worker (splitserve/faults.py)."""
        return self.spawn(name, [role.value, "--model", self.model, "--dtype", "float32",
                                 "--kv-cache-mib", "128", "--cpu-cores", str(core),
                                 "--kv-timeout-s", "5", EAGER_FLAG, *args], role,
                          env={**(self.env or os.environ), **faults.to_env()} if faults else None)

    def generation(self, router: Proc) -> generation_pb2_grpc.GenerationStub:
        ch = grpc.insecure_channel(router.address)
        self._channels.append(ch)
        return generation_pb2_grpc.GenerationStub(ch)

    def worker_stats(self, p: Proc) -> worker_pb2.StatsResponse:
        assert p.role is not None
        with grpc.insecure_channel(p.address) as ch:
            # Generous: a worker's event loop can stall for seconds while six engines share two
            # cores (a 5 s limit failed a cancel test in a full run). A late answer still says
            # what the worker held when it answered, which is what the callers check.
            return worker_stub(p.role, ch).Stats(worker_pb2.StatsRequest(), timeout=30)

    def held(self) -> dict[str, int]:
        """KV blocks each live prefill worker holds for decode workers right now."""
        return {p.name: self.worker_stats(p).load.held_kv_blocks for p in self.procs
                if p.role is Role.PREFILL and p.popen.poll() is None}

    def assert_workers_idle(self, timeout_s: float = 30.0) -> None:
        """The leak check: every live worker has nothing running, every KV block free, and no
        KV held for a decode worker (copies included)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if p.role is None or p.popen.poll() is not None:
                continue
            while True:
                load = self.worker_stats(p).load
                if (load.running == load.waiting == load.queue_len == 0
                        and load.free_kv_blocks == load.total_kv_blocks
                        and load.held_kv_blocks == load.held_kv_transfers == 0):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{p.name} not idle (leak?): {load}")
                time.sleep(0.1)

    def outcomes(self, router: str) -> dict[str, float]:
        """The router's `splitserve:requests_total` by outcome (its /metrics)."""
        return scrape.by_label(self.metrics(router), "splitserve:requests_total", "outcome")

    def metrics(self, router: str) -> str:
        """The router's /metrics page."""
        return scrape.fetch(self.by_name[router].endpoints["http"] + "/metrics")

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self.stop(grace_s=30)
        # Every engine process started under these sessions must be gone (SIGKILLed children
        # take a moment to be reaped).
        for _ in range(50):
            survivors = self.survivors()
            if not survivors:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"processes left behind: {survivors}")
        # Shared-memory KV segments go with their consumers (unlinked at shutdown, by the
        # producer when the connection ends, or by the resource tracker of a killed process).
        # Not asserted here: the fault tests SIGKILL whole workers, resource trackers and all,
        # and their segments stay until the next process to make one sweeps them
        # (shm.sweep_orphans, docs/kv-transfer.md); the KV modules' own leak checks are strict.
        for _ in range(50):
            if not shm.leftover_segments():
                return
            time.sleep(0.1)
        print(f"warning: shared KV segments left behind: {shm.leftover_segments()}")
