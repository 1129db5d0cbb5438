"""The transport tests' producers and consumers: a real Producer process per `producers()`, a
real Consumer per `consumers()`, and a pull that waits for its result.

Each test's shared-memory segments carry a tag of its own ($SPLITSERVE_KV_SHM_TAG, shm.py), set
for the test process and inherited by the producer processes: the leak check counts those alone,
so what another splitserve on this host (a cluster, a parallel test run) makes or removes
meanwhile changes nothing it counts."""

from __future__ import annotations

import os
import secrets
import time

import pytest

from bench.kv_producer import DEFAULTS, ProducerProc, caches_of
from splitserve.kv import shm
from splitserve.kv.consumer import Consumer, LoadResult, PullJob
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferStats

BASE = DEFAULTS


def own_segments() -> set[str]:
    """This test's segments in /dev/shm now (inside the `producers` fixture)."""
    return set(shm.leftover_segments(os.environ[shm.TAG_ENV]))


@pytest.fixture
def producers(monkeypatch):
    monkeypatch.setenv(shm.TAG_ENV, secrets.token_hex(4))  # before any segment of this test
    assert not own_segments()
    started: list[ProducerProc] = []

    def start(**overrides) -> ProducerProc:
        p = ProducerProc(**overrides)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
    # Every shared segment is unlinked with its owner: the consumers' (closed first: see
    # `consumers`) and the producers' hold arenas.
    assert not (left := own_segments()), f"shared KV segments left behind: {sorted(left)}"


@pytest.fixture
def consumers(producers):  # producers: set up before, torn down after the consumers
    started: list[Consumer] = []

    def start(transport: str = "pair", **overrides) -> Consumer:
        cfg = {**BASE, **overrides}
        caches = caches_of(cfg, seed=99)
        for t in caches.values():
            t.zero_()
        c = Consumer("test-d", ConnectorSettings(timeout_s=cfg["timeout_s"],
                                                 secret=cfg["secret"], transport=transport,
                                                 data_host=cfg["data_host"]),
                     TransferStats())
        c.start(caches, spec_from_caches(cfg["model"], cfg["block_size"], caches,
                                         cfg["cache_dtype"]))
        c.caches = caches
        started.append(c)
        return c

    yield start
    for c in started:
        c.shutdown()


def job(p: ProducerProc, tid: str, remote: list[int], local: list[int]) -> PullJob:
    return PullJob(tid, p.ticket(tid, remote), local, remote)


# Hang guards, not speed checks: a pull that has not ended in this long is hung (each of its
# network waits is bounded by the transfer timeout, 5 s here), however loaded the host.
HANG_S = 60.0


def pull(c: Consumer, p: ProducerProc, tid: str, remote: list[int], local: list[int]
         ) -> LoadResult:
    c.submit(job(p, tid, remote, local))
    (result,) = results_of(c, 1)
    assert result.req_id == tid
    return result


def results_of(c: Consumer, n: int) -> list[LoadResult]:
    """The consumer's next `n` results, in the order they ended (AssertionError if it hangs)."""
    results: list[LoadResult] = []
    deadline = time.monotonic() + HANG_S
    while len(results) < n:
        assert time.monotonic() < deadline, f"hung: {len(results)} of {n} pulls ended"
        results += c.take_results()
        time.sleep(0.01)
    assert len(results) == n, results
    return results


def wait_until(ready, what: str) -> None:
    """Poll `ready()` until it is true (AssertionError naming `what` if that takes HANG_S)."""
    deadline = time.monotonic() + HANG_S
    while not ready():
        assert time.monotonic() < deadline, f"hung waiting for {what}"
        time.sleep(0.02)


def arena_ready(p: ProducerProc, c: Consumer) -> int:
    """One pull so the consumer connects (the producer makes its arena then; that pull's hold
    came before it, in private memory); the arena's free bytes after."""
    p.cmd(op="hold", transfer_id="warm", block_ids=[0])
    assert pull(c, p, "warm", [0], [0]).ok
    info = p.cmd(op="connections")
    assert info["arena"] in own_segments()  # the producer process inherited the tag
    assert c.stats.total.arena_transfers == 0
    return info["arena_free"]
