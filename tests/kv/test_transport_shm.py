"""KV transport on one host: the consumer's shared segment (transport/shm.py) and the producer's
hold arena (transport/arena.py), with a real Producer process and a real Consumer (harness:
transport_harness.py). What they share with every transport: test_transport_conformance.py."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from bench.kv_producer import caches_of
from splitserve.kv import shm
from tests.kv.transport_harness import BASE, arena_ready, own_segments, pull, wait_until


def test_shared_segment_is_reused_and_grown_with_the_largest_pull(producers, consumers) -> None:
    p, c = producers(num_blocks=64, shape=[2, 128, 128]), consumers("auto", num_blocks=64,
                                                                  shape=[2, 128, 128])
    block = 3 * 2 * 128 * 128 * 2  # layers * heads * tokens * row * bf16: 192 KiB
    names = []
    for i, n in enumerate([2, 3, 40, 2]):  # 40 blocks (7.5 MiB) outgrow the first 1 MiB
        ids = list(range(n))
        p.cmd(op="hold", transfer_id=f"t{i}", block_ids=ids)
        assert pull(c, p, f"t{i}", ids, ids[::-1]).ok
        (peer,) = c._peers.values()
        names.append(peer.conn.end.staging.segment.name)
        assert peer.conn.end.staging.segment.size >= n * block
        # The one it replaced is unlinked.
        assert own_segments() == {names[-1]}
    assert names[0] == names[1] != names[2] == names[3]
    for name, want in p.expected([0, 1]).items():
        assert torch.equal(c.caches[name][[1, 0]].view(torch.uint8), want.view(torch.uint8))
    assert p.cmd(op="finished")["total"]["shm_transfers"] == 4


def test_a_producer_that_cannot_share_memory_gets_the_pair_channel(producers, consumers) -> None:
    """The consumer offers its segment; a producer that declines (another host, another IPC
    namespace, or told not to) is served over the pair channel, and the offer is unlinked."""
    p, c = producers(transport="pair"), consumers("auto")
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
    assert pull(c, p, "t1", [1, 2], [3, 4]).ok
    (peer,) = c._peers.values()
    assert peer.conn.offer == "pair"
    assert c.stats.total.shm_transfers == 0 and not own_segments()
    for name, want in p.expected([1, 2]).items():
        assert torch.equal(c.caches[name][[3, 4]].view(torch.uint8), want.view(torch.uint8))


def test_a_full_dev_shm_sends_the_transfer_over_the_pair_channel(producers, consumers,
                                                                  monkeypatch) -> None:
    """A container's /dev/shm is often 64 MiB. A segment that does not fit is refused when its
    pages are reserved (not by SIGBUS on first touch), and the pull goes over the pair channel,
    as does every later one to that producer."""
    import errno

    real = os.posix_fallocate

    def small_tmpfs(fd: int, offset: int, length: int) -> None:
        if length > shm.MIN_BYTES:  # room for the first segment only
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", small_tmpfs)
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
    assert peer.conn.offer == "pair"
    assert c.stats.total.transfers == 3 and c.stats.total.shm_transfers == 1
    assert not own_segments()


def test_a_same_host_consumer_reads_a_held_copy_out_of_the_arena(producers, consumers) -> None:
    """Copy-out holds land in the producer's shared arena; the consumer scatters straight out
    of it (its own segment unused), bit-exact, and the span is free again once the consumer has
    read it. (A subset of the held blocks, by dtype: test_transport_conformance.py.)"""
    remote, local = [1, 3, 7, 12, 9], [10, 2, 5, 15, 4]
    p, c = producers(copy_out=True), consumers("auto")
    free = arena_ready(p, c)
    assert p.cmd(op="hold", transfer_id="t1", block_ids=[1, 3, 7, 12, 9])["ok"]
    assert p.cmd(op="connections")["arena_free"] < free  # the copy is in the arena
    (peer,) = c._peers.values()
    # Our "read" and the next pull go out at once, not after the producer's delayed ACK.
    assert peer.conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    peer.conn.end.staging.segment.tensor(peer.conn.end.staging.segment.size).fill_(0)
    assert pull(c, p, "t1", remote, local).ok
    for name, want in p.expected(remote).items():
        assert torch.equal(c.caches[name][local].view(torch.uint8), want.view(torch.uint8))
    # Not through our segment: the producer wrote nothing into it.
    ours = peer.conn.end.staging.segment
    assert not ours.tensor(ours.size)[shm.NONCE_BYTES:].any()
    state = p.cmd(op="finished")
    assert state["status"]["held"] == 0 and state["status"]["sent"] == 2
    assert state["total"]["arena_transfers"] == c.stats.total.arena_transfers == 1
    assert c.stats.total.shm_transfers == 2
    assert p.cmd(op="connections")["arena_free"] == free


@pytest.mark.parametrize("end", ["lease", "release"])
def test_an_arena_copy_nobody_pulls_is_freed(producers, consumers, end: str) -> None:
    p, c = producers(copy_out=True, lease_s=0.5), consumers("auto")
    free = arena_ready(p, c)
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2, 3])
    assert p.cmd(op="connections")["arena_free"] < free
    if end == "release":
        assert p.cmd(op="release", transfer_id="t1")["state"] == "held"
        assert p.cmd(op="connections")["arena_free"] == free  # at once
    else:
        # Nobody asks the producer anything ("connections" reaps nothing): its accept loop
        # reaps expired leases every 0.5 s by itself.
        wait_until(lambda: p.cmd(op="connections")["arena_free"] == free, "the lease's reaping")
    res = pull(c, p, "t1", [1, 2, 3], [4, 5, 6])
    assert not res.ok and ("lease expired" if end == "lease" else "released") in res.error


def test_a_consumer_that_never_confirms_its_read_fails_the_transfer(producers) -> None:
    """The producer keeps the span until the consumer says it has read it; a consumer that
    goes away instead ends the transfer FAILED, and the span is free again."""
    from splitserve.kv import messages as m
    from splitserve.kv.spec import spec_from_caches
    from splitserve.kv.transport.shm import ConsumerStaging

    p = producers(copy_out=True)
    caches = caches_of(BASE)
    staging = ConsumerStaging()
    sock = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    try:
        m.recv(sock, m.Challenge)
        spec = spec_from_caches(BASE["model"], BASE["block_size"], caches).to_dict()
        m.send(sock, m.Hello("raw-d", "raw/link", None, spec, "c" * 32, "",
                             {"shm": staging.offer()}))
        assert m.recv(sock, m.Welcome).transport == "arena"
        free = p.cmd(op="connections")["arena_free"]
        p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
        m.send(sock, m.Pull("t1", [1, 2], {"segment": staging.segment.name}))
        reply = m.recv(sock, m.Pulled)
        assert reply.move["held"]["positions"] is None
        assert p.cmd(op="connections")["arena_free"] < free  # kept while we may be reading
    finally:
        sock.close()
        staging.close()
    wait_until(lambda: p.cmd(op="connections")["arena_free"] == free, "the span's release")
    assert p.cmd(op="finished")["status"]["failed"] == 1


def test_holds_that_do_not_fit_the_arena_travel_the_old_way(producers, consumers) -> None:
    """A 1 MiB arena holds a small copy but not a 7.5 MiB one: that one stays in private
    memory and is copied into the consumer's segment, as before the arena."""
    p = producers(copy_out=True, hold_arena_mib=1, num_blocks=64, shape=[2, 128, 128])
    c = consumers("auto", num_blocks=64, shape=[2, 128, 128])
    arena_ready(p, c)
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
    from splitserve.kv.transport.shm import ConsumerStaging, ProducerAttachment

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




def test_segments_carry_the_tag_of_their_process_tree(producers, consumers, monkeypatch) -> None:
    """The leak checks count a test's own segments by their tag (transport_harness.py): ours and
    our producer processes' carry it; another splitserve's on this host (untagged, or tagged by
    another test run) do not."""
    tag = os.environ[shm.TAG_ENV]
    with monkeypatch.context() as m:
        m.delenv(shm.TAG_ENV)
        untagged = shm.Segment.create(shm.MIN_BYTES)
        m.setenv(shm.TAG_ENV, "0" * 8 if tag != "0" * 8 else "1" * 8)
        other_run = shm.Segment.create(shm.MIN_BYTES)
    try:
        p, c = producers(copy_out=True), consumers("auto")
        arena_ready(p, c)
        (peer,) = c._peers.values()
        mine = {peer.conn.end.staging.segment.name, p.cmd(op="connections")["arena"]}
        assert all(n.startswith(shm.PREFIX + tag) for n in mine)
        assert own_segments() == mine
        assert {untagged.name, other_run.name} <= set(shm.leftover_segments())
    finally:
        untagged.close()
        other_run.close()
    with monkeypatch.context() as m:
        m.setenv(shm.TAG_ENV, "not-hex!")
        with pytest.raises(ValueError, match=shm.TAG_ENV):
            shm.Segment.create(shm.MIN_BYTES)
