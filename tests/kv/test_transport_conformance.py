"""Every transport keeps the same promises (splitserve/kv/transport/): one suite, run over each.

  pair    the consumer asks for the pair channel (the cross-host path); the producer copies
          holds out, so the bytes go from its private copy
  shm     same host, the consumer's segment; the producer holds vLLM's blocks, so it gathers
          from its cache straight into the segment
  arena   same host, the producer's shared hold arena: the consumer reads the held copy there
A real producer process and a real consumer each time (transport_harness.py); after every test
the harness checks that no shared-memory segment of the test's is left.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.faults import Faults
from splitserve.kv.transport import pair
from tests.kv.transport_harness import job, pull, results_of, wait_until

# path -> (the consumer's transport setting, the producer's settings)
PATHS = {"pair": ("pair", {"copy_out": True}), "shm": ("auto", {"copy_out": False}),
         "arena": ("auto", {"copy_out": True})}
EACH = pytest.mark.parametrize("path", list(PATHS))
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def pair_up(producers, consumers, path: str, faults: Faults | None = None, **cfg):
    """A producer and a consumer on `path`, connected: an arena is made at the first connect,
    so holds from then on land in it (a release connects without pulling)."""
    transport, prod = PATHS[path]
    p = producers(faults=faults, **prod, **cfg)
    c = consumers(transport, **cfg)
    c.release(p.ticket("connect", [0]))
    wait_until(lambda: p.cmd(op="connections")["accepted"] == 1
               and c._peers and not next(iter(c._peers.values())).lock.locked(),
               "the first connection")
    assert (p.cmd(op="connections")["arena"] is not None) == (path == "arena")
    return p, c


def assert_path(p, c, path: str, n: int) -> None:
    """Both ends counted `n` transfers, all over `path`."""
    total = p.cmd(op="finished")["total"]
    for t in (total, c.stats.total.to_dict()):
        assert t["transfers"] == n
        assert t["shm_transfers"] == (n if path != "pair" else 0)
        assert t["arena_transfers"] == (n if path == "arena" else 0)


def landed(p, c, remote: list[int], local: list[int]) -> bool:
    return all(torch.equal(c.caches[name][local].view(torch.uint8), want.view(torch.uint8))
               for name, want in p.expected(remote).items())


def untouched(c, but: list[int] = ()) -> bool:
    rest = [b for b in range(c.caches[next(iter(c.caches))].shape[0]) if b not in but]
    return not any(t[rest].view(torch.uint8).any() for t in c.caches.values())


@EACH
@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_exact_and_the_hold_ends(producers, consumers, path: str, dtype: str) -> None:
    """A subset of the held blocks, in another order, into other blocks: the bytes exact, no
    other block touched, the hold over once pulled."""
    p, c = pair_up(producers, consumers, path, dtype=dtype)
    remote, local = [3, 7, 1, 12], [10, 2, 5, 15]
    assert p.cmd(op="hold", transfer_id="t1", block_ids=[1, 3, 7, 12, 9])["ok"]
    assert pull(c, p, "t1", remote, local).ok
    assert landed(p, c, remote, local) and untouched(c, but=local)
    status = p.cmd(op="finished")["status"]
    assert (status["held"], status["claimed"], status["sent"]) == (0, 0, 1)
    assert_path(p, c, path, 1)


@EACH
def test_concurrent_pulls_land_in_their_own_blocks(producers, consumers, path: str) -> None:
    """Pulls queued at once from one producer each land where they belong; once the consumer
    is gone, so is its connection, and nothing stays held (nor, on the arena, allocated)."""
    p, c = pair_up(producers, consumers, path, num_blocks=32)
    free = p.cmd(op="connections")["arena_free"]
    jobs = {f"t{i}": ([2 * i + 1, 2 * i + 2], [30 - 2 * i, 29 - 2 * i]) for i in range(8)}
    for tid, (remote, _) in jobs.items():
        p.cmd(op="hold", transfer_id=tid, block_ids=remote)
    for tid, (remote, local) in jobs.items():
        c.submit(job(p, tid, remote, local))
    assert sorted(r.req_id for r in results_of(c, len(jobs)) if r.ok) == sorted(jobs)
    assert all(landed(p, c, remote, local) for remote, local in jobs.values())
    assert_path(p, c, path, len(jobs))
    c.shutdown()
    wait_until(lambda: p.cmd(op="connections")["connections"] == 0, "the connection's end")
    assert p.cmd(op="finished")["status"]["held"] == 0
    assert p.cmd(op="connections")["arena_free"] == free


@EACH
def test_a_producer_killed_mid_transfer_fails_the_pull_fast(producers, consumers,
                                                            path: str) -> None:
    """The producer claimed the pull and stalls with no byte delivered; killed there, the
    consumer learns it from the broken connection, not by waiting out its timeout. (That other
    producers keep serving it meanwhile: test_transport.py, a stalled producer.)"""
    dying, c = pair_up(producers, consumers, path, Faults(stall_before_send_s=60.0))
    dying.cmd(op="hold", transfer_id="t1", block_ids=[1, 2])
    c.submit(job(dying, "t1", [1, 2], [3, 4]))
    wait_until(lambda: dying.cmd(op="finished")["status"]["claimed"] == 1, "the pull's claim")
    assert c.take_results() == []
    dying.proc.kill()
    (result,) = results_of(c, 1)
    assert not result.ok and result.req_id == "t1"
    assert any(why in result.error for why in ("closed by peer", "reset by peer")), result.error
    assert "timed out" not in result.error and untouched(c), result.error


@EACH
def test_impostors_are_refused_both_ways(producers, consumers, path: str) -> None:
    """Mutual auth. A peer posing as a producer (no secret: it accepts anyone and serves
    blocks of its own) is refused before the consumer goes near its store or memory, so none
    of its bytes land; a consumer with the wrong secret is refused by the producer."""
    transport, prod = PATHS[path]
    impostor, c = producers(secret=None, **prod), consumers(transport, secret="s3cret")
    impostor.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(c, impostor, "t1", [1], [2])
    assert not res.ok and "did not prove the shared secret" in res.error, res.error
    assert impostor.cmd(op="finished")["status"]["held"] == 1 and untouched(c)
    genuine = producers(secret="s3cret", **prod)
    genuine.cmd(op="hold", transfer_id="t1", block_ids=[1])
    res = pull(consumers(transport, secret="guess"), genuine, "t1", [1], [2])
    assert not res.ok and "authentication failed" in res.error, res.error
    assert genuine.cmd(op="finished")["status"]["held"] == 1
    assert pull(c, genuine, "t1", [1], [2]).ok and landed(genuine, c, [1], [2])
    assert genuine.cmd(op="finished")["status"]["held"] == 0
    assert c.stats.total.shm_transfers == int(path != "pair")


def _listening(address: str) -> bool:
    """Whether some socket on this host listens on `address` (an IPv4 address), per the kernel."""
    want = "".join(f"{int(x):02X}" for x in reversed(address.split(".")))
    with open("/proc/net/tcp") as f:
        return any(row.split()[1].startswith(want + ":") and row.split()[3] == "0A"
                   for row in list(f)[1:])


def test_the_data_plane_takes_its_own_address(producers, consumers, monkeypatch) -> None:
    """`data_host` (--kv-data-host): the producer's process group listens there, and the
    consumer dials the pair channel's store at the address the welcome gives, not at the side
    channel's."""
    dialed = []
    real = pair.connect_store
    monkeypatch.setattr(pair, "connect_store", lambda host, *a: dialed.append(host) or real(
        host, *a))
    assert not _listening("127.0.0.2")
    p, c = pair_up(producers, consumers, "pair", data_host="127.0.0.2")
    assert _listening("127.0.0.2") and dialed == ["127.0.0.2"]
    remote, local = [2, 5], [9, 4]
    assert p.cmd(op="hold", transfer_id="d1", block_ids=remote)["ok"]
    assert pull(c, p, "d1", remote, local).ok and landed(p, c, remote, local)
    assert_path(p, c, "pair", 1)
