"""The e2e cluster, shared by the session (engines cost ~15 s each to start).

  P0 P1 prefill, D0 D1 decode — registered with router A (2P2D), HTTP front on
  router B: static list P0 + D0 (1P1D, and the static-worker path)
  router R: static colocated worker C (the colocated-vLLM reference)
  router O: P0 + D0 with one slot and a one-deep queue (overload)
  router E: no workers; router K: P0 + D0 behind an API key
After every test that uses it (`leak_check`) the workers are idle with every KV block free; at
the end of the session no process survives.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitserve.v1 import generation_pb2
from tests.e2e.cluster import ProcCluster

API_KEY = "test-key"


def wait_models(c: ProcCluster, router: str, prefill: int, decode: int) -> None:
    stub = c.generation(c.by_name[router])
    md = [("authorization", f"Bearer {API_KEY}")] if router == "K" else None
    deadline = time.monotonic() + 30
    while True:
        (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5,
                               metadata=md).models
        if (m.prefill_workers, m.decode_workers) == (prefill, decode):
            return
        assert time.monotonic() < deadline, f"router {router} sees {m}"
        time.sleep(0.2)


@pytest.fixture(scope="session")
def cl(tiny_model_dir: Path):
    c = ProcCluster(tiny_model_dir)
    try:
        c.router("A", "--heartbeat-timeout-s", "3")
        c.wait_ready(60)
        a = c.procs[0].address
        c.worker("P0", "prefill", 0, "--router", a)
        c.worker("D0", "decode", 1, "--router", a)
        c.worker("P1", "prefill", 0, "--router", a)
        c.worker("D1", "decode", 1, "--router", a)
        c.worker("C", "colocated", 0)
        c.wait_ready()
        w = {p.name: p.address for p in c.procs}
        pd = ["--static-prefill", w["P0"], "--static-decode", w["D0"]]
        c.router("B", *pd)
        c.router("R", "--static-colocated", w["C"])
        c.router("O", *pd, "--max-concurrency", "1", "--max-queue", "1")
        c.router("E")
        c.router("K", *pd, "--api-key", API_KEY)
        c.wait_ready()
        c.by_name = {p.name: p for p in c.procs}
        wait_models(c, "A", prefill=2, decode=2)
        for r in ("B", "O", "K"):
            wait_models(c, r, prefill=1, decode=1)
        wait_models(c, "R", prefill=0, decode=1)
        yield c
    finally:
        c.close()


@pytest.fixture
def leak_check(cl: ProcCluster):
    yield
    cl.assert_workers_idle()
