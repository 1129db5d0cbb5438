"""Routing policy: prefix affinity bounded by load, prefill by queued prompt tokens."""

from __future__ import annotations

import random
from collections import Counter

from router.policy import block_hashes, choose_decode, choose_prefill, prefix_key
from router.registry import Worker
from splitserve.roles import Role
from splitserve.v1 import common_pb2, registry_pb2

BLOCK = 128


def _worker(name: str, role: Role = Role.PREFILL, *, inflight: int = 0, tokens: int = 0,
            queue: int = 0, free: int = 1000, running: int = 0) -> Worker:
    return Worker(worker_id=name, role=role, address=f"{name}:1", model="m",
                  capacity=registry_pb2.WorkerCapacity(max_num_seqs=64, total_kv_blocks=1000,
                                                       block_size=BLOCK),
                  channel=None, stub=None, session=None, last_seen=0.0,
                  load=common_pb2.WorkerLoad(queue_len=queue, free_kv_blocks=free,
                                             total_kv_blocks=1000, running=running),
                  inflight=inflight, inflight_tokens=tokens)


def _prompt(head: int, tail: int, n: int = 300) -> list[int]:
    """A prompt whose first block is `head`'s and whose rest is `tail`'s."""
    rng_h, rng_t = random.Random(head), random.Random(10_000 + tail)
    return ([rng_h.randrange(4096) for _ in range(BLOCK)]
            + [rng_t.randrange(4096) for _ in range(n - BLOCK)])


def test_prefix_key_is_the_first_full_block() -> None:
    assert prefix_key(_prompt(1, 1)[:BLOCK - 1], BLOCK) is None  # no block to share
    assert prefix_key(_prompt(1, 1), BLOCK) == prefix_key(_prompt(1, 2), BLOCK)
    assert prefix_key(_prompt(1, 1), BLOCK) != prefix_key(_prompt(2, 1), BLOCK)
    assert prefix_key(_prompt(1, 1), 0) is None  # a static worker whose block size is unknown
    # The same digest the router remembers workers' caches by (router/split.py), one spelling.
    long = _prompt(1, 1) + _prompt(2, 1)
    assert prefix_key(long, BLOCK) == block_hashes(long, BLOCK)[0]
    assert block_hashes(long, BLOCK, limit=1) == block_hashes(long, BLOCK)[:1]


def test_a_shared_prefix_goes_to_one_prefill_worker_and_prefixes_spread() -> None:
    pool = [_worker(f"p{i}") for i in range(4)]
    homes = {choose_prefill(pool, 300, prefix_key(_prompt(7, t), BLOCK)).worker_id
             for t in range(20)}
    assert len(homes) == 1
    spread = Counter(choose_prefill(pool, 300, prefix_key(_prompt(h, 0), BLOCK)).worker_id
                     for h in range(400))
    assert set(spread) == {w.worker_id for w in pool} and min(spread.values()) > 50


def test_a_prefix_keeps_its_home_when_another_worker_leaves() -> None:
    pool = [_worker(f"p{i}") for i in range(4)]
    keys = [prefix_key(_prompt(h, 0), BLOCK) for h in range(100)]
    before = [choose_prefill(pool, 300, k).worker_id for k in keys]
    after = [choose_prefill(pool[1:], 300, k).worker_id for k in keys]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert moved and all(b == "p0" for b, _ in moved)  # only p0's prefixes found a new home


def test_an_overloaded_home_is_passed_over() -> None:
    key = prefix_key(_prompt(3, 0), BLOCK)
    idle = [_worker(f"p{i}") for i in range(3)]
    home = choose_prefill(idle, 300, key)
    busy = [_worker(w.worker_id, inflight=20, tokens=20 * 1000) if w is home else w
            for w in idle]
    assert choose_prefill(busy, 300, key).worker_id != home.worker_id


def test_prefill_without_a_prefix_takes_the_fewest_queued_prompt_tokens() -> None:
    # One 2,000-token prompt costs more than three of 100: fewest requests would pick `long`.
    long = _worker("long", inflight=1, tokens=2000, queue=1)
    short = _worker("short", inflight=3, tokens=300, queue=3)
    assert choose_prefill([long, short], 100).worker_id == "short"
    # Requests in the worker's queue that are not ours count at this request's length.
    others = _worker("others", queue=4)
    assert choose_prefill([others, short], 1000).worker_id == "short"


def test_decode_follows_the_prefix_while_its_home_has_room() -> None:
    rng = random.Random(0)
    pool = [_worker(f"d{i}", Role.DECODE) for i in range(4)]
    key = prefix_key(_prompt(5, 0), BLOCK)
    assert len({choose_decode(pool, rng, key).worker_id for _ in range(20)}) == 1
    home = choose_decode(pool, rng, key)
    full = [_worker(w.worker_id, Role.DECODE, free=0) if w is home else w for w in pool]
    assert all(choose_decode(full, rng, key).worker_id != home.worker_id for _ in range(20))
    # No prefix: two random probes, so over many requests every worker is used.
    assert len({choose_decode(pool, rng).worker_id for _ in range(100)}) == 4
