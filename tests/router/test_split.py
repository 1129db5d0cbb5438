"""Conditional disaggregation's rule on hand-made workers and a hand-driven clock (end to end,
with real engines: tests/e2e/test_conditional.py)."""

from __future__ import annotations

import random

import pytest

from router.policy import block_hashes
from router.split import Placement, PrefillSplit, PrefixMemory
from splitserve.roles import Role
from tests.router.test_policy import BLOCK, _worker
from tests.router.test_slo import Clock


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def _pair():
    return _worker("p0"), _worker("d0", Role.DECODE)


def _served(split: PrefillSplit, clock: Clock, prefill, decode, n: int, seconds: float,
            gap_s: float = 0.05, seed: int = 99):
    """One request placed, prefilled in `seconds`, its second token `gap_s` later."""
    p = split.place(_ids(n, seed), prefill, decode)
    track = split.started(p, prefill if p.remote else None, decode, 2)
    clock.t += seconds
    track.tokens(1)
    clock.t += gap_s
    track.tokens(1)
    track.close()
    return p


def test_block_hashes_cover_whole_prefixes() -> None:
    a, b = _ids(3 * BLOCK + 5, 1), _ids(3 * BLOCK + 5, 2)
    assert len(block_hashes(a, BLOCK)) == 3  # full blocks only
    assert block_hashes(a[:BLOCK - 1], BLOCK) == []
    mixed = a[:2 * BLOCK] + b[2 * BLOCK:]
    assert block_hashes(mixed, BLOCK)[:2] == block_hashes(a, BLOCK)[:2]
    assert block_hashes(mixed, BLOCK)[2] != block_hashes(a, BLOCK)[2]
    # A block equal to another prompt's is not a shared prefix when what precedes it differs.
    shifted = b[:BLOCK] + a[BLOCK:]
    assert block_hashes(shifted, BLOCK)[1] != block_hashes(a, BLOCK)[1]


def test_prefix_memory_counts_leading_blocks_and_forgets_the_oldest() -> None:
    mem = PrefixMemory()
    w = _worker("d0", Role.DECODE)
    w.capacity.total_kv_blocks = 4
    a = block_hashes(_ids(3 * BLOCK, 1), BLOCK)
    mem.sent(w, a)
    assert mem.cached_blocks("d0", a) == 3
    assert mem.cached_blocks("d0", block_hashes(_ids(3 * BLOCK, 1)[:2 * BLOCK] + _ids(BLOCK, 5),
                                                BLOCK)) == 2
    assert mem.cached_blocks("other", a) == 0
    mem.sent(w, block_hashes(_ids(2 * BLOCK, 2), BLOCK))  # 5 blocks > capacity 4: a[0] goes
    assert mem.cached_blocks("d0", a) == 0
    mem.forget_except(set())
    assert mem.cached_blocks("d0", block_hashes(_ids(2 * BLOCK, 2), BLOCK)) == 0


def test_before_any_measurement_an_idle_decode_worker_prefills_locally() -> None:
    split = PrefillSplit(Clock())
    p, d = _pair()
    assert not split.place(_ids(1500), p, d).remote  # a tie: nothing to stall, nothing queued
    d.inflight = 1  # one request decoding there: the long prompt would stall it
    assert split.place(_ids(1500), p, d).remote


def test_a_burst_spreads_over_both_sides_by_queued_tokens() -> None:
    split = PrefillSplit(Clock())
    p, d = _pair()
    where = []
    for i in range(5):  # all placed before any answers, as a burst is
        pl = split.place(_ids(1000, i), p, d)
        split.started(pl, p if pl.remote else None, d, 16)
        if not pl.remote:
            d.inflight += 1  # it decodes there after its local prefill
        where.append(pl.remote)
    # local (idle); remote: 1000 < 2000+1000; remote 2000 < 3000; tie 3000 = 3000 -> local;
    # remote: 3000+1000 < (2000+1000) + 2 x 1000
    assert where == [False, True, True, False, True]


def test_the_stall_on_a_busy_batch_outweighs_the_hand_off_only_for_long_prompts() -> None:
    clock = Clock()
    split = PrefillSplit(clock)
    p, d = _pair()
    d.inflight = 1  # busy: these go remote
    for i in range(3):  # both sides measured at 10,000 tokens/s; hand-off 100 ms over local
        assert _served(split, clock, p, d, 1000, 0.1, gap_s=0.15, seed=i).remote
    d.inflight = 0
    for i in range(3):
        assert not _served(split, clock, p, d, 1000, 0.1, gap_s=0.05, seed=10 + i).remote
    assert split.meters["p0"].rate() == pytest.approx(10_000)
    assert split.meters["d0"].rate() == pytest.approx(10_000)
    assert split.handoff_s() == pytest.approx(0.1, rel=0.5)
    d.inflight = 4  # four requests decoding there
    short, long_ = split.place(_ids(100, 50), p, d), split.place(_ids(2000, 51), p, d)
    assert not short.remote  # stalls 4 x 10 ms < a ~100 ms hand-off
    assert long_.remote  # stalls 4 x 200 ms > the hand-off
    assert short.costs.local < short.costs.remote and long_.costs.remote < long_.costs.local


def test_a_queued_prefill_pool_sends_even_long_prompts_local() -> None:
    clock = Clock()
    split = PrefillSplit(clock)
    p, d = _pair()
    d.inflight = 1
    for i in range(3):
        assert _served(split, clock, p, d, 1000, 0.1, seed=i).remote
    assert split.place(_ids(2000, 7), p, d).remote
    split.meter(p).start(20_000)  # two seconds of prompts queued on the prefill worker
    assert not split.place(_ids(2000, 7), p, d).remote


def test_a_prefix_the_decode_worker_holds_makes_its_prefill_cheap() -> None:
    split = PrefillSplit(Clock())
    p, d = _pair()
    d.inflight = 1
    system = _ids(10 * BLOCK, 3)
    first = split.place(system + _ids(20, 4), p, d)
    assert first.remote  # the decode worker is busy and holds nothing
    split.started(first, p, d, 16).close()
    # The KV went to both workers; a prefill worker with a queue loses to a decode worker that
    # computes 20 tokens instead of 1,300.
    split.meter(p).start(1000)
    again = split.place(system + _ids(20, 5), p, d)
    assert not again.remote and again.prefill_tokens == 20


def test_an_abandoned_prefill_leaves_nothing_queued() -> None:
    split = PrefillSplit(Clock())
    p, d = _pair()
    d.inflight = 1
    pl = split.place(_ids(900), p, d)
    split.started(pl, p, d, 16).close()  # failed or cancelled before its first token
    assert split.meters["p0"].pending == 0
    assert split.meters["p0"].rate() is None  # and it taught the rate nothing


def _measured(tpot_slo_s: float | None):
    """A split whose workers both prefill 10,000 tokens/s, with a 100 ms hand-off, and whose
    prefill worker has two seconds of prompts queued: by seconds, a prompt goes local."""
    clock = Clock()
    split = PrefillSplit(clock, tpot_slo_s=tpot_slo_s)
    p, d = _pair()
    d.inflight = 1
    for i in range(3):
        _served(split, clock, p, d, 1000, 0.1, gap_s=0.15, seed=i)
    d.inflight = 0
    for i in range(3):
        _served(split, clock, p, d, 1000, 0.1, gap_s=0.05, seed=10 + i)
    split.meter(p).start(20_000)
    return split, clock, p, d


def _streaming(split: PrefillSplit, clock: Clock, p, d, max_tokens: int, tokens: int,
               step_s: float):
    """A request decoding on `d`: `tokens` out so far, one per `step_s` after a 50 ms gap."""
    pl = split.place(_ids(300, 77), p, d)
    track = split.started(pl, p if pl.remote else None, d, max_tokens)
    track.tokens(1)
    clock.t += 0.05
    track.tokens(1)
    for _ in range(tokens - 2):
        clock.t += step_s
        track.tokens(1)
    d.inflight += 1
    return track


def test_with_a_tpot_slo_a_local_prefill_must_leave_every_stream_inside_it() -> None:
    for slo in (None, 0.02):
        split, clock, p, d = _measured(slo)
        # 20 of 100 tokens out at 10 ms each after a 50 ms gap: 0.24 s so far, 0.8 s to go;
        # a 1,000-token prefill stalls it 0.1 s: (0.24 + 0.1 + 0.8) / 99 = 11.5 ms per token.
        track = _streaming(split, clock, p, d, 100, 20, 0.010)
        pl = split.place(_ids(1000, 8), p, d)
        assert not pl.remote and pl.costs.local_keeps_tpot  # 0.1 s x 2 < 2 s queued remotely
        # 5,000 tokens (0.5 s) would take it to (0.24 + 0.5 + 0.8) / 99 = 15.6 ms: still inside.
        assert not split.place(_ids(5000, 9), p, d).remote
        # A tighter stream: 20 of 30 tokens out. The short prompt still fits its budget,
        # (0.24 + 0.1 + 0.1) / 29 = 15 ms; the long one would not: (0.24 + 0.5 + 0.1) / 29 = 29 ms.
        track.close()
        d.inflight -= 1
        track = _streaming(split, clock, p, d, 30, 20, 0.010)
        assert not split.place(_ids(1000, 8), p, d).remote
        long_ = split.place(_ids(5000, 9), p, d)
        assert long_.remote == (slo is not None), slo  # seconds alone: local (0.5 x 2 < 2.5)
        assert long_.costs.local < long_.costs.remote
        assert long_.costs.local_keeps_tpot == (slo is None)
        track.close()  # the stream left: nothing on the decode worker to protect
        d.inflight -= 1
        assert not split.place(_ids(5000, 9), p, d).remote
        assert split.streams == {}


def test_a_stream_already_past_the_tpot_slo_keeps_prompts_off_its_worker() -> None:
    split, clock, p, d = _measured(0.02)
    track = _streaming(split, clock, p, d, 30, 10, 0.030)  # 30 ms a token: past it already
    assert split.place(_ids(100, 8), p, d).remote  # even 10 ms of stall
    track.close()
    d.inflight -= 1
    assert not split.place(_ids(100, 8), p, d).remote


def test_a_stream_without_a_pace_of_its_own_goes_at_the_workers() -> None:
    split, clock, p, d = _measured(0.02)
    paced = _streaming(split, clock, p, d, 1000, 20, 0.019)  # a long one, near the SLO's pace
    pl = split.place(_ids(300, 78), p, d)
    fresh = split.started(pl, p if pl.remote else None, d, 30)
    fresh.tokens(1)  # first token only: no pace; at the worker's 19 ms it ends at 19.x ms
    d.inflight += 1
    # (0 + 0.1 + 29 x 0.019) / 29 = 22 ms: the 1,000-token prefill would push it past 20 ms;
    # at no pace at all it would have fitted (0.1 / 29 = 3.4 ms).
    assert split.place(_ids(1000, 8), p, d).remote
    fresh.close()
    paced.close()
    assert split.streams == {}


def test_a_stream_waiting_for_its_hand_off_counts_the_gap_still_to_come() -> None:
    for remote in (True, False):
        split, clock, p, d = _measured(0.02)  # gaps seen: remote 150 ms, local 50 ms
        ids = _ids(300, 78)
        track = split.started(Placement(remote, 300, block_hashes(ids, BLOCK)),
                              p if remote else None, d, 16)
        track.tokens(1)  # its first token, no second yet, no pace anywhere
        d.inflight += 1
        # A 2,000-token prefill stalls it 0.2 s. Remote: its second token is still due after
        # the 150 ms hand-off, (0.15 + 0.2) / 15 = 23 ms; local: (0.05 + 0.2) / 15 = 17 ms.
        assert split.place(_ids(2000, 8), p, d).remote == remote, remote
        track.close()
