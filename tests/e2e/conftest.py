"""The e2e cluster, shared by the e2e tests (engines cost ~15 s each to start).

  P0 P1 prefill, D0 D1 decode — registered with router A (2P2D), HTTP front on
  router B: static list P0 + D0 (1P1D, and the static-worker path)
  router R: static colocated worker C (the colocated-vLLM reference)
  router O: P0 + D0 with one slot and a one-deep queue (overload)
  router E: no workers; router K: P0 + D0 behind an API key
  router S: P0 + DS, a decode worker whose every Decode waits 60 s before reaching its engine
            (a ticket the router holds stays unpulled while a test cancels or lets time run out)
  router X: P0 + C listed as a decode worker (C refuses tickets: a Decode that fails unpulled)
After every test that uses it (`leak_check`) the workers are idle with every KV block free and no
KV held for a decode worker; at the end of the session no process survives.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitserve.faults import Faults
from splitserve.roles import Role
from splitserve.v1 import generation_pb2
from tests.e2e.cluster import ProcCluster

API_KEY = "test-key"
STALL_S = 60


def registered(c: ProcCluster, router: str) -> tuple[int, int]:
    """(prefill, decode) workers `router` serves with right now (its ListModels)."""
    md = [("authorization", f"Bearer {API_KEY}")] if router == "K" else None
    (m,) = c.generation(c.by_name[router]).ListModels(generation_pb2.ListModelsRequest(),
                                                      timeout=5, metadata=md).models
    return m.prefill_workers, m.decode_workers


def wait_models(c: ProcCluster, router: str, prefill: int, decode: int,
                within_s: float = 30.0) -> None:
    """Until `router` serves with exactly these worker counts; `within_s` is the promise under
    test where a caller passes one (a heartbeat timeout, a re-registration), else a hang guard."""
    deadline = time.monotonic() + within_s
    while (seen := registered(c, router)) != (prefill, decode):
        assert time.monotonic() < deadline, f"router {router} serves with {seen}"
        time.sleep(0.2)


def static_router(c: ProcCluster, name: str, prefill: tuple[str, ...] = (),
                  decode: tuple[str, ...] = (), colocated: tuple[str, ...] = (),
                  *args: str) -> None:
    """A router of its own over workers of the shared cluster (by name), listed as static
    workers; returns once it sees them all."""
    w = {p.name: p.address for p in c.procs}
    flags = [f for role, names in (("prefill", prefill), ("decode", decode),
                                   ("colocated", colocated))
             for n in names for f in (f"--static-{role}", w[n])]
    c.router(name, *flags, *args)
    c.wait_ready([c.by_name[name]], 60)
    wait_models(c, name, prefill=len(prefill), decode=len(decode) + len(colocated))


@pytest.fixture(scope="package")  # gone before the next directory's tests start engines
def cl(tiny_model_dir: Path):
    c = ProcCluster(tiny_model_dir)
    try:
        a = c.router("A")
        c.wait_ready([a], 60)
        c.worker("P0", Role.PREFILL, 0, "--router", a.address)
        c.worker("D0", Role.DECODE, 1, "--router", a.address)
        c.worker("P1", Role.PREFILL, 0, "--router", a.address)
        c.worker("D1", Role.DECODE, 1, "--router", a.address)
        c.worker("C", Role.COLOCATED, 0)
        c.worker("DS", Role.DECODE, 1, faults=Faults(stall_decode_s=STALL_S))
        # Six engines loading at once on two cores take minutes (~2.5 each on an AVX2 host).
        # Inside pytest's own 900 s limit, which this setup counts against: a slow start fails
        # with this wait's message (which engine, its log), not a bare timeout.
        c.wait_ready(timeout_s=600)
        w = {p.name: p.address for p in c.procs}
        pd = ["--static-prefill", w["P0"], "--static-decode", w["D0"]]
        c.router("B", *pd)
        c.router("R", "--static-colocated", w["C"])
        c.router("O", *pd, "--max-concurrency", "1", "--max-queue", "1")
        c.router("E")
        c.router("K", *pd, env={"SPLITSERVE_API_KEY": API_KEY})
        c.router("S", "--static-prefill", w["P0"], "--static-decode", w["DS"])
        c.router("X", "--static-prefill", w["P0"], "--static-decode", w["C"])
        c.router("I", "--static-colocated", w["C"], "--stream-interval", "3")
        c.wait_ready()
        wait_models(c, "A", prefill=2, decode=2)
        for r in ("B", "O", "K", "S", "X"):
            wait_models(c, r, prefill=1, decode=1)
        wait_models(c, "R", prefill=0, decode=1)
        wait_models(c, "I", prefill=0, decode=1)
        yield c
    finally:
        c.close()


@pytest.fixture(autouse=True)
def own_processes(request: pytest.FixtureRequest):
    """What a test started on the shared cluster (its own routers, a worker to kill) stops when
    the test ends: idle routers still poll their workers, and the next tests share the cores.
    Torn down after `leak_check`, which looks at the workers through them."""
    if "cl" not in request.fixturenames:
        yield
        return
    c: ProcCluster = request.getfixturevalue("cl")
    before = len(c.procs)
    yield
    c.stop_some(c.procs[before:])


@pytest.fixture
def leak_check(cl: ProcCluster):
    yield
    cl.assert_workers_idle()
