"""The transport tests' producers and consumers: a real Producer process per `producers()`, a
real Consumer per `consumers()`, and a pull that waits for its result."""

from __future__ import annotations

import time

import pytest

from bench.kv_producer import DEFAULTS, ProducerProc, caches_of
from splitserve.kv import shm
from splitserve.kv.consumer import Consumer, LoadResult, PullJob
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferStats

BASE = DEFAULTS
BOTH = pytest.mark.parametrize("transport", ["pair", "auto"], ids=["pair", "shm"])


@pytest.fixture
def producers():
    started: list[ProducerProc] = []
    before = set(shm.leftover_segments())  # a session cluster's workers may hold their own

    def start(**overrides) -> ProducerProc:
        p = ProducerProc(**overrides)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
    # Every shared segment is unlinked with its owner: the consumers' (closed first: see
    # `consumers`) and the producers' hold arenas.
    assert set(shm.leftover_segments()) <= before


@pytest.fixture
def consumers(producers):  # producers: set up before, torn down after the consumers
    started: list[Consumer] = []

    def start(transport: str = "pair", **overrides) -> Consumer:
        cfg = {**BASE, **overrides}
        caches = caches_of(cfg, seed=99)
        for t in caches.values():
            t.zero_()
        c = Consumer("test-d", ConnectorSettings(timeout_s=cfg["timeout_s"],
                                                 secret=cfg["secret"], transport=transport),
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


def pull(c: Consumer, p: ProducerProc, tid: str, remote: list[int], local: list[int],
         wait_s: float = 20.0) -> LoadResult:
    c.submit(job(p, tid, remote, local))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        results = c.take_results()
        if results:
            assert len(results) == 1 and results[0].req_id == tid
            return results[0]
        time.sleep(0.01)
    raise AssertionError(f"no result for {tid} within {wait_s} s")


def arena_ready(p: ProducerProc, c: Consumer) -> int:
    """One pull so the consumer connects (the producer makes its arena then; that pull's hold
    came before it, in private memory); the arena's free bytes after."""
    p.cmd(op="hold", transfer_id="warm", block_ids=[0])
    assert pull(c, p, "warm", [0], [0]).ok
    info = p.cmd(op="connections")
    assert info["arena"] in shm.leftover_segments()
    assert c.stats.total.arena_transfers == 0
    return info["arena_free"]
