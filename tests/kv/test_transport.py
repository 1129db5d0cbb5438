"""KV transport without vLLM: a real Producer process, a real Consumer, real gloo and sockets.

The cache tensors are plain tensors shaped like vLLM's ([blocks, kv_heads, block_size, C]), so
these tests run in seconds and can kill, stall or mismatch the producer at will.

Consumers here use the pair channel (the cross-host path) unless a test asks for "auto", which on
this one host takes the shared-memory path (shm.py); the tests that matter for both run on both.
"""

from __future__ import annotations

import signal
import socket
import time

import pytest
import torch

from bench.kv_producer import DEFAULTS, ProducerProc, caches_of
from splitserve.kv import shm
from splitserve.kv.consumer import Consumer, LoadResult, PullJob
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferStats
from splitserve.kv.ticket import KVTicket, TransferId
from splitserve.net import free_port

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


# Every dtype on the pair channel; shared memory moves the same raw words, so fewer suffice.
_EXACT = [("pair", d, c) for d in ("float32", "bfloat16", "float16", "float8_e4m3fn")
          for c in (False, True)] + [("auto", "bfloat16", False), ("auto", "bfloat16", True),
                                     ("auto", "float8_e4m3fn", True)]


@pytest.mark.parametrize(("transport", "dtype", "copy_out"), _EXACT, ids=[
    f"{'shm' if t == 'auto' else t}-{d}-{'copy-out' if c else 'hold-blocks'}"
    for t, d, c in _EXACT])
def test_pull_is_bit_exact_and_frees_the_lease(producers, consumers, dtype: str,
                                               copy_out: bool, transport: str) -> None:
    p, c = producers(dtype=dtype, copy_out=copy_out), consumers(transport, dtype=dtype)
    remote, local = [3, 7, 1, 12], [10, 2, 5, 15]
    assert p.cmd(op="hold", transfer_id="t1", block_ids=[1, 3, 7, 12, 9])["ok"]
    res = pull(c, p, "t1", remote, local)
    assert res.ok, res.error
    for name, want in p.expected(remote).items():
        got = c.caches[name][local]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    untouched = [b for b in range(BASE["num_blocks"]) if b not in local]
    assert all(not t[untouched].view(torch.uint8).any() for t in c.caches.values())
    state = p.cmd(op="finished")
    assert state["finished"] == ["t1"] and state["status"]["held"] == 0
    assert state["total"]["transfers"] == 1 and state["total"]["bytes"] > 0
    # Both ends agree on the path the bytes took.
    shared = int(transport == "auto")
    assert state["total"]["shm_transfers"] == c.stats.total.shm_transfers == shared


def test_staging_buffer_is_reused_across_transfers(producers, consumers) -> None:
    p, c = producers(), consumers()
    ptrs = []
    for i in range(3):
        p.cmd(op="hold", transfer_id=f"t{i}", block_ids=[1, 2, 3])
        assert pull(c, p, f"t{i}", [1, 2, 3], [4, 5, 6]).ok
        (peer,) = c._peers.values()
        ptrs.append(peer.conn.chan.staging(1).data_ptr())
    assert len(set(ptrs)) == 1


def test_shared_segment_is_reused_and_grown_with_the_largest_pull(producers, consumers) -> None:
    baseline = set(shm.leftover_segments())  # a session cluster's own
    p, c = producers(num_blocks=64, shape=[2, 128, 128]), consumers("auto", num_blocks=64,
                                                                  shape=[2, 128, 128])
    block = 3 * 2 * 128 * 128 * 2  # layers * heads * tokens * row * bf16: 192 KiB
    names = []
    for i, n in enumerate([2, 3, 40, 2]):  # 40 blocks (7.5 MiB) outgrow the first 1 MiB
        ids = list(range(n))
        p.cmd(op="hold", transfer_id=f"t{i}", block_ids=ids)
        assert pull(c, p, f"t{i}", ids, ids[::-1]).ok
        (peer,) = c._peers.values()
        names.append(peer.conn.shm.segment.name)
        assert peer.conn.shm.segment.size >= n * block
        # The one it replaced is unlinked.
        assert set(shm.leftover_segments()) - baseline == {names[-1]}
    assert names[0] == names[1] != names[2] == names[3]
    for name, want in p.expected([0, 1]).items():
        assert torch.equal(c.caches[name][[1, 0]].view(torch.uint8), want.view(torch.uint8))
    assert p.cmd(op="finished")["total"]["shm_transfers"] == 4


def test_a_producer_that_cannot_share_memory_gets_the_pair_channel(producers, consumers) -> None:
    """The consumer offers its segment; a producer that declines (another host, another IPC
    namespace, or told not to) is served over the pair channel, and the offer is unlinked."""
    baseline = set(shm.leftover_segments())  # a session cluster's own
    p, c = producers(transport="pair"), consumers("auto")
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
    assert pull(c, p, "t1", [1, 2], [3, 4]).ok
    (peer,) = c._peers.values()
    assert peer.conn.shm is None and peer.conn.chan is not None
    assert c.stats.total.shm_transfers == 0 and set(shm.leftover_segments()) <= baseline
    for name, want in p.expected([1, 2]).items():
        assert torch.equal(c.caches[name][[3, 4]].view(torch.uint8), want.view(torch.uint8))


def test_a_full_dev_shm_sends_the_transfer_over_the_pair_channel(producers, consumers,
                                                                  monkeypatch) -> None:
    """A container's /dev/shm is often 64 MiB. A segment that does not fit is refused when its
    pages are reserved (not by SIGBUS on first touch), and the pull goes over the pair channel,
    as does every later one to that producer."""
    import errno
    import os

    real = os.posix_fallocate

    def small_tmpfs(fd: int, offset: int, length: int) -> None:
        if length > shm.MIN_BYTES:  # room for the first segment only
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", small_tmpfs)
    baseline = set(shm.leftover_segments())  # a session cluster's own
    p = producers(num_blocks=64)
    c = consumers("auto", num_blocks=64)
    block = 3 * 2 * 32 * 128 * 2  # 48 KiB: 40 blocks need a bigger segment than "fits"
    for i, (n, local) in enumerate([(2, [50, 51]), (40, list(range(39, -1, -1))),
                                    (3, [60, 61, 62])]):
        ids = list(range(n))
        p.cmd(op="hold", transfer_id=f"t{i}", block_ids=ids)
        assert pull(c, p, f"t{i}", ids, local).ok
    assert 40 * block > shm.MIN_BYTES
    for name, want in p.expected(list(range(40))).items():
        assert torch.equal(c.caches[name][list(range(39, -1, -1))].view(torch.uint8),
                           want.view(torch.uint8))
    (peer,) = c._peers.values()
    assert peer.conn.shm is None and peer.conn.chan is not None
    assert c.stats.total.transfers == 3 and c.stats.total.shm_transfers == 1
    assert set(shm.leftover_segments()) <= baseline


def _arena_ready(p: ProducerProc, c: Consumer) -> int:
    """One pull so the consumer connects (the producer makes its arena then; that pull's hold
    came before it, in private memory); the arena's free bytes after."""
    p.cmd(op="hold", transfer_id="warm", block_ids=[0])
    assert pull(c, p, "warm", [0], [0]).ok
    info = p.cmd(op="connections")
    assert info["arena"] in shm.leftover_segments()
    assert c.stats.total.arena_transfers == 0
    return info["arena_free"]


@pytest.mark.parametrize(("remote", "local"), [([1, 3, 7, 12, 9], [10, 2, 5, 15, 4]),
                                               ([3, 7, 1, 12], [10, 2, 5, 15])],
                         ids=["all-held", "a-subset"])
def test_a_same_host_consumer_reads_a_held_copy_out_of_the_arena(producers, consumers,
                                                                remote, local) -> None:
    """Copy-out holds land in the producer's shared arena; the consumer scatters straight out
    of it (its own segment unused), bit-exact, also for a subset of the held blocks (a prefix
    hit on the decode side), and the span is free again once the consumer has read it."""
    p, c = producers(copy_out=True), consumers("auto")
    free = _arena_ready(p, c)
    assert p.cmd(op="hold", transfer_id="t1", block_ids=[1, 3, 7, 12, 9])["ok"]
    assert p.cmd(op="connections")["arena_free"] < free  # the copy is in the arena
    (peer,) = c._peers.values()
    # Our "read" and the next pull go out at once, not after the producer's delayed ACK.
    assert peer.conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    peer.conn.shm.segment.tensor(peer.conn.shm.segment.size).fill_(0)
    assert pull(c, p, "t1", remote, local).ok
    for name, want in p.expected(remote).items():
        assert torch.equal(c.caches[name][local].view(torch.uint8), want.view(torch.uint8))
    # Not through our segment: the producer wrote nothing into it.
    assert not peer.conn.shm.segment.tensor(peer.conn.shm.segment.size)[shm.NONCE_BYTES:].any()
    state = p.cmd(op="finished")
    assert state["status"]["held"] == 0 and state["status"]["sent"] == 2
    assert state["total"]["arena_transfers"] == c.stats.total.arena_transfers == 1
    assert c.stats.total.shm_transfers == 2
    assert p.cmd(op="connections")["arena_free"] == free


@pytest.mark.parametrize("end", ["lease", "release"])
def test_an_arena_copy_nobody_pulls_is_freed(producers, consumers, end: str) -> None:
    p, c = producers(copy_out=True, lease_s=0.5), consumers("auto")
    free = _arena_ready(p, c)
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2, 3])
    assert p.cmd(op="connections")["arena_free"] < free
    if end == "release":
        assert p.cmd(op="release", transfer_id="t1")["state"] == "held"
    else:
        time.sleep(1.2)  # the accept loop reaps expired leases every 0.5 s
    assert p.cmd(op="connections")["arena_free"] == free
    assert not pull(c, p, "t1", [1, 2, 3], [4, 5, 6]).ok


def test_a_consumer_that_never_confirms_its_read_fails_the_transfer(producers) -> None:
    """The producer keeps the span until the consumer says it has read it; a consumer that
    goes away instead ends the transfer FAILED, and the span is free again."""
    from splitserve.kv.spec import spec_from_caches
    from splitserve.kv.wire import recv_msg, send_msg

    p = producers(copy_out=True)
    caches = caches_of(BASE)
    staging = shm.ConsumerStaging()
    sock = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    try:
        challenge = recv_msg(sock)
        assert challenge["op"] == "challenge"
        send_msg(sock, {"op": "hello", "engine_id": "raw-d", "pair_key": "raw/pair",
                        "spec": spec_from_caches(BASE["model"], BASE["block_size"],
                                                 caches).to_dict(),
                        "challenge": "c" * 32, "shm": staging.offer()})
        assert recv_msg(sock)["shm"] is True
        free = p.cmd(op="connections")["arena_free"]
        p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
        send_msg(sock, {"op": "pull", "transfer_id": "t1", "block_ids": [1, 2], "tag": 1,
                        "shm": staging.segment.name, "arena": True})
        reply = recv_msg(sock)
        assert reply["ok"] and reply["arena"]["positions"] is None
        assert p.cmd(op="connections")["arena_free"] < free  # kept while we may be reading
    finally:
        sock.close()
        staging.close()
    deadline = time.monotonic() + 5
    while p.cmd(op="connections")["arena_free"] != free:
        assert time.monotonic() < deadline, "the span outlived its consumer"
        time.sleep(0.05)
    assert p.cmd(op="finished")["status"]["failed"] == 1


def test_holds_that_do_not_fit_the_arena_travel_the_old_way(producers, consumers) -> None:
    """A 1 MiB arena holds a small copy but not a 7.5 MiB one: that one stays in private
    memory and is copied into the consumer's segment, as before the arena."""
    p = producers(copy_out=True, hold_arena_mib=1, num_blocks=64, shape=[2, 128, 128])
    c = consumers("auto", num_blocks=64, shape=[2, 128, 128])
    _arena_ready(p, c)
    for i, n in enumerate([2, 40]):  # 384 KiB fits, 7.5 MiB does not
        ids = list(range(1, n + 1))
        p.cmd(op="hold", transfer_id=f"t{i}", block_ids=ids)
        assert pull(c, p, f"t{i}", ids, ids[::-1]).ok
        for name, want in p.expected(ids).items():
            assert torch.equal(c.caches[name][ids[::-1]].view(torch.uint8),
                               want.view(torch.uint8))
    assert c.stats.total.arena_transfers == 1 and c.stats.total.shm_transfers == 3


def test_a_forged_segment_offer_is_not_taken(producers) -> None:
    """The producer takes the path only if it reads the offer's nonce in the named segment."""
    from splitserve.kv.shm import ConsumerStaging, ProducerAttachment

    staging = ConsumerStaging()
    try:
        good = ProducerAttachment.accept(staging.offer())
        assert good is not None
        good.close()
        assert ProducerAttachment.accept({**staging.offer(), "nonce": "00" * 16}) is None
        assert ProducerAttachment.accept({"name": "../../etc/passwd", "nonce": ""}) is None
        assert ProducerAttachment.accept({"name": shm.PREFIX + "0" * 24, "nonce": ""}) is None
    finally:
        staging.close()


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("block_size", 64, "block_size: ours 32, peer's 64"),
    ("dtype", "float16", "dtype: ours 'torch.bfloat16', peer's 'torch.float16'"),
    ("model", "other-model", "model: ours 'm', peer's 'other-model'"),
    ("cache_dtype", "fp8_e5m2", "cache_dtype: ours 'fp8_e4m3', peer's 'fp8_e5m2'"),
])
def test_incompatible_peer_is_refused_at_handshake(producers, consumers, field, value, needle):
    # fp8 caches: vLLM stores e4m3 and e5m2 alike in uint8 tensors; only cache_dtype tells them
    # apart ("fp8" is e4m3, so the producer's spelling differs from its canonical name).
    theirs = {"dtype": "uint8", "cache_dtype": "fp8"} if field == "cache_dtype" else {}
    p, c = producers(**theirs), consumers(**{**theirs, field: value})
    p.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(c, p, "t1", [1], [2])
    assert not res.ok and "incompatible KV cache" in res.error and needle in res.error
    assert not any(t.view(torch.uint8).any() for t in c.caches.values())


def test_wrong_secret_is_refused(producers, consumers) -> None:
    p, c = producers(secret="s3cret"), consumers(secret="guess")
    p.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(c, p, "t1", [1], [2])
    assert not res.ok and "authentication failed" in res.error
    good = consumers(secret="s3cret")
    assert pull(good, p, "t1", [1], [2]).ok


@pytest.mark.parametrize("copy_out", [False, True], ids=["hold-blocks", "copy-out"])
def test_lease_expiry_frees_blocks_and_refuses_a_late_pull(producers, consumers,
                                                           copy_out: bool) -> None:
    p, c = producers(lease_s=0.3, copy_out=copy_out), consumers()
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
    time.sleep(0.5)
    state = p.cmd(op="finished")
    assert state["finished"] == ["t1"] and state["status"]["held"] == 0
    assert state["total"]["lease_expired"] == 1
    res = pull(c, p, "t1", [1, 2], [3, 4])
    assert not res.ok and "lease expired" in res.error


def test_unknown_transfer_is_refused_after_a_bounded_wait(producers, consumers) -> None:
    p, c = producers(), consumers()
    t0 = time.monotonic()
    res = pull(c, p, "never-held", [1], [2])
    assert not res.ok and "unknown" in res.error
    # Bound, not a benchmark: the producer waits at most 2.5 s (half the 5 s timeout) for a hold
    # to appear; 10 s leaves 4x room for a loaded machine and still fails a hang.
    assert time.monotonic() - t0 < 10


@BOTH
def test_producer_killed_mid_transfer_fails_fast(producers, consumers, transport: str) -> None:
    dying, healthy = producers(stall_before_send_s=60.0), producers()
    c = consumers(transport)
    dying.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
    c.submit(job(dying, "t1", [1, 2], [3, 4]))
    time.sleep(1.0)  # the producer is stalling before the send (pair) or its reply (shm)
    assert c.take_results() == []
    dying.proc.kill()
    t_kill = time.monotonic()
    while not (results := c.take_results()):
        # Bound: a dead peer must surface within the transfer timeout (5 s) plus slack for a
        # busy machine; without the timeout the consumer would wait forever.
        assert time.monotonic() - t_kill < BASE["timeout_s"] + 2, "consumer hung on a dead peer"
        time.sleep(0.01)
    assert not results[0].ok
    # Other pairs keep working, and so does a fresh pair to a new producer.
    healthy.cmd(op="hold", transfer_id="t2", block_ids=[5])
    assert pull(c, healthy, "t2", [5], [6]).ok


def test_dead_producer_address_fails_fast(consumers) -> None:
    c = consumers()
    t0 = time.monotonic()
    ticket = KVTicket(TransferId("t1"), "nobody", "127.0.0.1", free_port(), (1,), 32,
                      time.time() + 60, "")
    res = c.submit(PullJob("t1", ticket, [1], [1]))
    while not (results := c.take_results()):
        # Bound: a refused connection is immediate; 5 s (the transfer timeout) rules out a hang.
        assert time.monotonic() - t0 < 5
        time.sleep(0.01)
    assert res is None and not results[0].ok and "cannot reach" in results[0].error


def test_layout_mismatch_is_refused(producers, consumers) -> None:
    """A GPU-style [B, N, H, C] memory order must not be mistaken for the CPU's [B, H, N, C]."""
    from splitserve.kv.spec import physical_layout

    p, c = producers(), consumers()
    strided = {k: v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
               for k, v in c.caches.items()}
    assert physical_layout(next(iter(strided.values()))) == "LBNHC"
    c.start(strided, spec_from_caches("m", BASE["block_size"], strided))
    p.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(c, p, "t1", [1], [2])
    assert not res.ok and "layout: ours 'LBHNC', peer's 'LBNHC'" in res.error


@BOTH
def test_concurrent_pulls_from_one_producer_land_in_their_own_blocks(producers, consumers,
                                                                     transport: str) -> None:
    p, c = producers(num_blocks=32), consumers(transport, num_blocks=32)
    jobs = {f"t{i}": ([2 * i + 1, 2 * i + 2], [30 - 2 * i, 29 - 2 * i]) for i in range(8)}
    for tid, (remote, _) in jobs.items():
        p.cmd(op="hold", transfer_id=tid, block_ids=remote)
    for tid, (remote, local) in jobs.items():
        c.submit(job(p, tid, remote, local))
    results: list[LoadResult] = []
    deadline = time.monotonic() + 30
    while len(results) < len(jobs) and time.monotonic() < deadline:
        results += c.take_results()
        time.sleep(0.01)
    assert sorted(r.req_id for r in results if r.ok) == sorted(jobs)
    for remote, local in jobs.values():
        for name, want in p.expected(remote).items():
            assert torch.equal(c.caches[name][local].view(torch.uint8), want.view(torch.uint8))


def test_copy_out_returns_the_blocks_at_once(producers, consumers) -> None:
    """Copy-out: vLLM gets the blocks back before anyone pulls; the pull reads the copy."""
    p, c = producers(copy_out=True), consumers()
    p.cmd(op="hold", transfer_id="t1", block_ids=[4, 5])
    state = p.cmd(op="finished")
    assert state["finished"] == ["t1"] and state["status"]["held"] == 1  # blocks back, copy leased
    assert pull(c, p, "t1", [4, 5], [1, 2]).ok
    after = p.cmd(op="finished")
    assert after["finished"] == [] and after["status"]["held"] == 0  # the copy is gone too
    for name, want in p.expected([4, 5]).items():
        assert torch.equal(c.caches[name][[1, 2]].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("copy_out", [False, True], ids=["hold-blocks", "copy-out"])
def test_status_counts_transfers_by_state(producers, consumers, copy_out: bool) -> None:
    p, c = producers(copy_out=copy_out), consumers()
    assert p.cmd(op="finished")["status"] == {"held": 0, "claimed": 0, "sent": 0, "released": 0,
                                              "expired": 0, "failed": 0, "held_blocks": 0}
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2, 3])
    p.cmd(op="hold", transfer_id="t2", block_ids=[4])
    status = p.cmd(op="finished")["status"]
    assert status["held"] == 2 and status["held_blocks"] == 4
    assert pull(c, p, "t1", [2, 3], [4, 5]).ok
    assert p.cmd(op="release", transfer_id="t2") == {"state": "held"}
    status = p.cmd(op="finished")["status"]
    assert (status["held"], status["held_blocks"], status["sent"], status["released"]) == (
        0, 0, 1, 1)
    # Ended transfers answer precisely: a second release and a late pull both say what happened.
    assert p.cmd(op="release", transfer_id="t2") == {"state": "released"}
    assert p.cmd(op="release", transfer_id="t1") == {"state": "sent"}
    res = pull(c, p, "t2", [4], [6])
    assert not res.ok and "released" in res.error


def test_release_before_the_hold_frees_it_on_arrival(producers) -> None:
    """The router may give up while the prefill is finishing: its Release can overtake the
    engine step that registers the hold. The hold must then end at once, not at lease expiry."""
    p = producers(lease_s=60.0)
    assert p.cmd(op="release", transfer_id="early") == {"state": "unknown"}
    p.cmd(op="hold", transfer_id="early", block_ids=[1, 2])
    state = p.cmd(op="finished")
    assert state["finished"] == ["early"]  # vLLM gets the blocks back now
    assert state["status"]["held"] == 0 and state["status"]["released"] == 1


def test_a_stalled_producer_does_not_delay_pulls_from_another(producers, consumers) -> None:
    """Each producer connection has its own lock: while one producer sits on our handshake (it
    is frozen: the kernel accepts the TCP connection, nothing answers), a pull from a healthy
    producer completes and the stalled one fails only when its own timeout runs out."""
    stalled, healthy = producers(), producers()
    c = consumers(timeout_s=5.0)
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        c.submit(job(stalled, "s1", [1], [1]))
        time.sleep(0.2)  # the stalled job holds its connection's lock, waiting on the handshake
        healthy.cmd(op="hold", transfer_id="h1", block_ids=[2])
        c.submit(job(healthy, "h1", [2], [3]))
        results: list[LoadResult] = []
        while not results:
            results += c.take_results()
            time.sleep(0.01)
        # The healthy pull is the first to finish; before the fix it waited for the stalled
        # handshake's 5 s timeout behind a lock shared by all producers, and came second.
        assert [(r.req_id, r.ok) for r in results] == [("h1", True)]
        while len(results) < 2:
            results += c.take_results()
            time.sleep(0.05)
        assert [(r.req_id, r.ok) for r in results] == [("h1", True), ("s1", False)]
    finally:
        stalled.proc.send_signal(signal.SIGCONT)


def test_a_hung_producer_costs_one_timeout_not_one_per_in_step_load(producers,
                                                                     consumers) -> None:
    """An in-step load makes the decode batch wait. Once a load from a hung producer (frozen:
    the kernel accepts the connection, nothing answers) has timed out, further loads from it
    fail at once for the timeout's length instead of each waiting it out; then it is tried
    again and, thawed, serves."""
    timeout_s = 3.0
    hung = producers()
    c = consumers(timeout_s=timeout_s)
    hung.cmd(op="hold", transfer_id="t2", block_ids=[2])
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        assert not c.load_now(job(hung, "t1", [1], [1]))  # waits out its timeout
        t0 = time.monotonic()
        assert not c.load_now(job(hung, "t2", [2], [2]))
        # Bound, not a benchmark: without the mark this load waits another full timeout.
        assert time.monotonic() - t0 < timeout_s / 2
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    assert c.stats.drain().failures == 2
    time.sleep(timeout_s)  # the mark lapses; the next load connects afresh
    assert c.load_now(job(hung, "t2", [2], [3]))


@BOTH
def test_a_producer_without_the_secret_is_refused_by_the_consumer(producers, consumers,
                                                                  transport: str) -> None:
    """Mutual auth: the producer proves the secret too. A peer posing as a producer — one that
    accepts any consumer and serves blocks of its own — is refused before the consumer goes
    near the store it names, so no bytes of its are ever scattered into our cache."""
    impostor, c = producers(secret=None), consumers(transport, secret="s3cret")
    impostor.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(c, impostor, "t1", [1], [2])
    assert not res.ok and "did not prove the shared secret" in res.error, res.error
    assert impostor.cmd(op="finished")["status"]["held"] == 1  # nothing was pulled
    assert not any(t.view(torch.uint8).any() for t in c.caches.values())
    genuine = producers(secret="s3cret")
    genuine.cmd(op="hold", transfer_id="t1", block_ids=[1])
    good = consumers(transport, secret="s3cret")
    assert pull(good, genuine, "t1", [1], [2]).ok
    assert good.stats.total.shm_transfers == int(transport == "auto")


def test_a_consumer_without_the_secret_is_refused_by_the_producer(producers, consumers) -> None:
    p = producers(secret="s3cret")
    p.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(consumers(secret=None), p, "t1", [1], [2])
    assert not res.ok and "authentication failed" in res.error
    assert p.cmd(op="finished")["status"]["held"] == 1


def test_connections_beyond_the_bound_are_turned_away(producers, consumers) -> None:
    """A flood of connections costs the producer at most `max_connections` threads; the rest
    are told why and closed, and once a slot frees a real consumer pulls as usual."""
    import socket

    from splitserve.kv.wire import recv_msg

    p = producers(max_connections=2)
    held = [socket.create_connection(("127.0.0.1", p.port), timeout=5) for _ in range(2)]
    for s in held:  # each is being served: its challenge arrived (and its hello never will)
        assert recv_msg(s)["op"] == "challenge"
    extra = [socket.create_connection(("127.0.0.1", p.port), timeout=5) for _ in range(5)]
    for s in extra:
        msg = recv_msg(s)
        assert not msg["ok"] and "limit of 2 connection(s)" in msg["error"]
        s.close()
    state = p.cmd(op="connections")
    assert state["connections"] == 2 and state["threads"] == 3  # two served + the accept loop
    c = consumers()
    p.cmd(op="hold", transfer_id="t1", block_ids=[1])
    refused = pull(c, p, "t1", [1], [2])
    assert not refused.ok and "limit of 2" in refused.error
    for s in held:
        s.close()
    deadline = time.monotonic() + 10
    while p.cmd(op="connections")["connections"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert pull(c, p, "t1", [1], [2]).ok
