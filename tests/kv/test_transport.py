"""KV transport without vLLM: a real Producer process, a real Consumer, real gloo and sockets.

The cache tensors are plain tensors shaped like vLLM's ([blocks, kv_heads, block_size, C]), so
these tests run in seconds and can kill, stall or mismatch the producer at will.

Consumers here use the pair channel (the cross-host path). What every transport must do alike
(bit-exact bytes by dtype, concurrent pulls, a producer killed mid-transfer, impostors on either
side, cleanup): test_transport_conformance.py. The same-host paths' own tests (their segments,
the hold arena): test_transport_shm.py. Fixtures: transport_harness.py.
"""

from __future__ import annotations

import logging
import signal
import socket
import time

import pytest
import torch

from splitserve.kv.consumer import PullJob
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.ticket import KVTicket, TransferId
from tests.kv.transport_harness import BASE, job, pull, results_of, wait_until


def test_staging_buffer_is_reused_across_transfers(producers, consumers) -> None:
    p, c = producers(), consumers()
    ptrs = []
    for i in range(3):
        p.cmd(op="hold", transfer_id=f"t{i}", block_ids=[1, 2, 3])
        assert pull(c, p, f"t{i}", [1, 2, 3], [4, 5, 6]).ok
        (peer,) = c._peers.values()
        ptrs.append(peer.conn.end.chan.staging(1).data_ptr())
    assert len(set(ptrs)) == 1



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
    """The producer waits for the hold to appear only half the transfer timeout, so its refusal
    reaches the consumer before the consumer's own timeout would end the pull ("timed out")."""
    p, c = producers(), consumers()
    res = pull(c, p, "never-held", [1], [2])
    assert not res.ok and "unknown to this producer (never held)" in res.error, res.error


def test_dead_producer_address_fails_fast(consumers) -> None:
    """Nothing listens there: the kernel refuses the connection at once, and so does the pull
    (not after its connect timeout, whose error would say "timed out")."""
    c = consumers()
    with socket.socket() as held:  # bound, never listening: the port stays ours, and refuses
        held.bind(("127.0.0.1", 0))
        ticket = KVTicket(TransferId("t1"), "nobody", "127.0.0.1", held.getsockname()[1], (1,),
                          32, time.time() + 60, "")
        res = c.submit(PullJob("t1", ticket, [1], [1]))
        (result,) = results_of(c, 1)
    assert res is None and not result.ok
    assert "cannot reach" in result.error and "Connection refused" in result.error, result.error


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
    producer completes, and the stalled one goes on once its producer thaws. (A stalled
    producer that never thaws fails its pull at the timeout: the next test.)"""
    stalled, healthy = producers(), producers()
    # Far beyond the test: the stalled pull ends only when we thaw its producer, so the order
    # below is the locks' doing, however slow this host is.
    c = consumers(timeout_s=120.0)
    stalled.cmd(op="hold", transfer_id="s1", block_ids=[1])
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        c.submit(job(stalled, "s1", [1], [1]))
        # The stalled job holds its connection's lock, waiting on the handshake.
        key = ("127.0.0.1", stalled.port)
        wait_until(lambda: key in c._peers and c._peers[key].lock.locked(), "the stalled pull")
        healthy.cmd(op="hold", transfer_id="h1", block_ids=[2])
        c.submit(job(healthy, "h1", [2], [3]))
        # The healthy pull ends while the stalled one still waits; before the fix it waited
        # behind a lock shared by all producers, and came second (after the stalled timeout).
        assert [(r.req_id, r.ok) for r in results_of(c, 1)] == [("h1", True)]
        assert c.take_results() == []
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
    assert [(r.req_id, r.ok) for r in results_of(c, 1)] == [("s1", True)]


@pytest.mark.budget(20)  # it waits out one transfer timeout (5 s) by design
def test_a_hung_producer_costs_one_timeout_not_one_per_in_step_load(producers, consumers,
                                                                     caplog) -> None:
    """An in-step load makes the decode batch wait. Once a load from a hung producer (frozen:
    the kernel accepts the connection, nothing answers) has timed out, further loads from it
    fail at once for the timeout's length instead of each waiting it out; then it is tried
    again and, thawed, serves."""
    timeout_s = 3.0
    hung = producers()
    c = consumers(timeout_s=timeout_s)
    hung.cmd(op="hold", transfer_id="t2", block_ids=[2])
    hung.proc.send_signal(signal.SIGSTOP)
    caplog.set_level(logging.WARNING, logger="splitserve.kv.consumer")
    try:
        assert not c.load_now(job(hung, "t1", [1], [1]))  # waits out its timeout
        assert not c.load_now(job(hung, "t2", [2], [2]))
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    first, second = (r.getMessage() for r in caplog.records if "failed:" in r.getMessage())
    assert "timed out" in first, first
    # Failed at once on the mark; without it, this load would wait out another timeout.
    assert "is marked down" in second and "timed out waiting" not in second, second
    assert c.stats.drain().failures == 2
    time.sleep(timeout_s)  # the mark lapses (it lasts the timeout); the next load connects afresh
    assert c.load_now(job(hung, "t2", [2], [3]))


def test_connections_beyond_the_bound_are_turned_away(producers, consumers) -> None:
    """A flood of connections costs the producer at most `max_connections` threads; the rest
    are told why and closed, and once a slot frees a real consumer pulls as usual."""

    from splitserve.kv import messages as m

    p = producers(max_connections=2)
    held = [socket.create_connection(("127.0.0.1", p.port), timeout=5) for _ in range(2)]
    for s in held:  # each is being served: its challenge arrived (and its hello never will)
        assert isinstance(m.recv(s, m.Challenge), m.Challenge)
    extra = [socket.create_connection(("127.0.0.1", p.port), timeout=5) for _ in range(5)]
    for s in extra:
        assert "limit of 2 connection(s)" in m.recv(s, m.Refusal).error
        s.close()
    state = p.cmd(op="connections")
    assert state["connections"] == 2 and state["threads"] == 3  # two served + the accept loop
    c = consumers()
    p.cmd(op="hold", transfer_id="t1", block_ids=[1])
    refused = pull(c, p, "t1", [1], [2])
    assert not refused.ok and "limit of 2" in refused.error
    for s in held:
        s.close()
    wait_until(lambda: not p.cmd(op="connections")["connections"], "the closed connections' end")
    assert pull(c, p, "t1", [1], [2]).ok
