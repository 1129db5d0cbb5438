"""Conditional disaggregation: per request, prefill on a prefill worker or on the decode worker.

A remote prefill keeps the decode worker's steps free of the prompt's compute, but the request
pays for it twice: it waits in the prefill pool's queue, and its KV has to reach the decode worker
before the second token (the hand-off). A local prefill pays neither, but every request already
decoding on that worker stalls while the prompt runs. Which is cheaper changes per request: a
short prompt or an idle decode worker favours local, a long prompt next to a busy batch or an
idle prefill pool favours remote, and a prefix one side already caches shrinks that side's work.

The rule compares the delay each choice adds, in seconds (`Costs`), and takes the smaller:

    remote = (prompt tokens queued on the prefill worker + the prompt's uncached part there)
             / that worker's prefill rate  +  the hand-off
    local  = (prompt tokens queued for local prefill on the decode worker + uncached part there)
             / its prefill rate  +  (requests decoding there) x (uncached part / its rate)

The last term is what the others lose: each request in the decode batch waits through the
prefill. Every input is measured online by the router, as `splitserve plan` models a pool
offline: each worker's prefill rate and queue (a `PrefillMeter` per worker, router/slo.py), the
hand-off (first-to-second-token gap of remote requests beyond that of local ones), the decode
batch (the router's own requests on the worker, or its heartbeat's running count if larger) and
the prefixes each worker holds (`PrefixMemory`: the block hashes the router has sent it).
Before a rate is known the same rule runs with every rate equal and no hand-off: a prompt goes
local exactly when the decode worker has nothing to stall and nothing queued beyond what the
prefill worker has. Ties go local (no transfer to pay for, nothing held on two workers).

Seconds summed over a batch are not what a client is promised, though: with a TPOT SLO
(`--tpot-slo`, or `--admit-tpot-slo` when only that is set), a local prefill must also leave
every stream decoding on that worker inside it. Each stream's time per output token is projected
to its end, as the router streams it: its time since its first token, plus the stall (the local
prefills queued there and this one, at the worker's prefill rate), plus its remaining tokens at
its own pace since its second token (one still waiting for that token gets it after the gap
measured for its placement: the hand-off, for a remote prefill), over its tokens after the first
(`max_tokens`: a stream that stops early at its end-of-sequence token spreads the stall over
fewer tokens than that, so the check is optimistic for it). A stall that would push any of them
past the SLO, or one already past it, sends the prompt remote, whatever the seconds say: a chat
prompt's prefill is cheap once, but on a busy decode worker it lands in every stream's steps,
and a long document's 16 tokens have little room for anyone's prefill (docs/benchmarks.md, the
mixed workload).

Off unless the router runs with `--conditional-disaggregation`; off, a prompt disaggregates
unless it is shorter than `--local-prefill-threshold` or the request asks for a local prefill.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.policy import block_hashes
from router.registry import Worker
from router.slo import PrefillMeter

_DECAY = 0.9  # weight of the past in the hand-off estimates (about the last ten requests)
_MAX_REMEMBERED = 65536  # block hashes kept per worker when it reports no KV capacity



class PrefixMemory:
    """The prompt blocks the router has sent each worker, oldest forgotten first: an estimate
    of its prefix cache (vLLM evicts least recently used blocks too) bounded by its KV blocks."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def cached_blocks(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of a prompt (its `hashes`) the worker probably still holds."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def sent(self, w: Worker, hashes: Sequence[bytes]) -> None:
        held = self._held.setdefault(w.worker_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        cap = w.capacity.total_kv_blocks or _MAX_REMEMBERED
        while len(held) > cap:
            held.popitem(last=False)

    def forget_except(self, worker_ids: set[str]) -> None:
        for gone in self._held.keys() - worker_ids:
            del self._held[gone]


@dataclass(frozen=True, slots=True)
class Costs:
    """What one request's prefill would add, in seconds (token units while rates are unknown)."""

    remote: float
    local: float
    # False: a local prefill would push a stream decoding on that worker past the TPOT SLO.
    local_keeps_tpot: bool = True

    @property
    def is_remote(self) -> bool:
        return self.remote < self.local or not self.local_keeps_tpot


@dataclass(slots=True)
class Placement:
    """One request's decision, and what its prefill is measured against."""

    remote: bool
    prefill_tokens: int  # the uncached part of the prompt on the worker that prefills it
    hashes: list[bytes]
    costs: Costs | None = None  # None: not decided here (forced local, or no prefill pool)


@dataclass(slots=True, eq=False)  # kept in sets: each one is itself
class _Stream:
    """A request streaming from a decode worker, as the router sees its tokens arrive."""

    expected: int  # output tokens it may stream in all (its max_tokens)
    remote: bool  # prefilled on a prefill worker: its second token waits for the hand-off
    first_at: float | None = None
    tokens: int = 0
    mark_at: float = 0.0  # the event after the first token: its pace is measured from here,
    mark_tokens: int = 0  # beyond the hand-off's gap
    last_at: float = 0.0

    def add(self, n: int, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        elif not self.mark_tokens:
            self.mark_at, self.mark_tokens = now, self.tokens + n
        self.tokens += n
        self.last_at = now

    def pace(self) -> float | None:
        """Seconds per token since its second token, or None before two events after it."""
        if not self.mark_tokens or self.tokens <= self.mark_tokens:
            return None
        return (self.last_at - self.mark_at) / (self.tokens - self.mark_tokens)

    def tpot_after(self, stall_s: float, now: float, pace: float, gap_s: float) -> float:
        """Its time per output token at its end, were it stalled `stall_s` now; `pace`: its
        seconds per token from here, `gap_s`: the first-to-second-token gap its placement
        shows (the hand-off, for a remote prefill), which its second token is still due in."""
        assert self.first_at is not None
        elapsed = now - self.first_at
        left = max(self.expected - self.tokens, 0)
        if self.tokens == 1 and left:
            span = max(elapsed, gap_s) + (left - 1) * pace
        else:
            span = elapsed + left * pace
        return (span + stall_s) / max(self.expected - 1, 1)


class _Gap:
    """Decayed mean of the first-to-second-token gap."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, s: float) -> None:
        self.value = s if self.value is None else _DECAY * self.value + (1 - _DECAY) * s


class PrefillSplit:
    """Decides remote or local prefill per request, and learns from how requests went."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 tpot_slo_s: float | None = None) -> None:
        self.clock = clock
        self.tpot_slo_s = tpot_slo_s
        self.meters: dict[str, PrefillMeter] = {}
        self.prefixes = PrefixMemory()
        self._gap = {True: _Gap(), False: _Gap()}  # keyed by remote
        self.streams: dict[str, set[_Stream]] = {}  # by decode worker id

    def meter(self, w: Worker) -> PrefillMeter:
        m = self.meters.get(w.worker_id)
        if m is None:
            m = self.meters[w.worker_id] = PrefillMeter(self.clock)
        return m

    def handoff_s(self) -> float:
        """What a remote prefill adds between the first and second token over a local one."""
        remote, local = self._gap[True].value, self._gap[False].value
        if remote is None:
            return 0.0
        return max(remote - (local or 0.0), 0.0)

    def _rate(self, w: Worker) -> float | None:
        own = self.meter(w).rate()
        if own is not None:
            return own
        # A worker not measured yet runs the same model: the mean of the ones measured.
        known = [r for r in (m.rate() for m in self.meters.values()) if r is not None]
        return sum(known) / len(known) if known else None

    def costs(self, up: int, ud: int, prefill: Worker, decode: Worker) -> Costs:
        """`up`, `ud`: the prompt's uncached tokens on the prefill and on the decode worker."""
        rp, rd = self._rate(prefill), self._rate(decode)
        rates_unknown = rp is None or rd is None
        if rates_unknown:  # equal rates, no hand-off: compare token counts
            rp = rd = 1.0
            handoff = 0.0
        else:
            handoff = self.handoff_s()
        mp, md = self.meter(prefill), self.meter(decode)
        batch = max(decode.inflight, decode.load.running)
        keeps = (self.tpot_slo_s is None or rates_unknown
                 or self.keeps_tpot(decode, (md.pending + ud) / rd))
        return Costs(remote=(mp.pending + up) / rp + handoff,
                     local=(md.pending + ud) / rd + batch * ud / rd, local_keeps_tpot=keeps)

    def keeps_tpot(self, decode: Worker, stall_s: float) -> bool:
        """Whether every stream decoding on `decode` stays inside the TPOT SLO through a stall
        of `stall_s` seconds now. A stream without a pace of its own yet goes at the worker's
        (the mean of those that have one), or at no time per token when none has; one still
        waiting for its second token gets it after the gap measured for its placement."""
        assert self.tpot_slo_s is not None
        live = [s for s in self.streams.get(decode.worker_id, ()) if s.first_at is not None]
        if not live:
            return True
        paced = [(s, s.pace()) for s in live]
        paces = [p for _, p in paced if p is not None]
        step = sum(paces) / len(paces) if paces else 0.0
        gaps = {remote: g.value if g.value is not None else step
                for remote, g in self._gap.items()}
        now = self.clock()
        for s, pace in paced:
            if s.tpot_after(stall_s, now, step if pace is None else pace,
                            gaps[s.remote]) > self.tpot_slo_s:
                return False
        return True

    def place(self, prompt_ids: Sequence[int], prefill: Worker | None,
              decode: Worker) -> Placement:
        """Where the prompt prefills; `prefill` None: local already (the request asked for it,
        the prompt is under the threshold, or there is no prefill pool)."""
        block_size = decode.capacity.block_size
        hashes = block_hashes(prompt_ids, block_size)
        if prefill is None:
            return Placement(False, self._uncached(len(prompt_ids), hashes, block_size, decode),
                             hashes)
        up = self._uncached(len(prompt_ids), hashes, block_size, prefill)
        ud = self._uncached(len(prompt_ids), hashes, block_size, decode)
        c = self.costs(up, ud, prefill, decode)
        return Placement(c.is_remote, up if c.is_remote else ud, hashes, c)

    def _uncached(self, prompt_len: int, hashes: Sequence[bytes], block_size: int,
                  w: Worker) -> int:
        cached = self.prefixes.cached_blocks(w.worker_id, hashes) * block_size
        return max(prompt_len - cached, 1)  # vLLM always computes the last prompt token

    def started(self, p: Placement, prefill: Worker | None, decode: Worker,
                max_tokens: int) -> Track:
        """The request goes out as placed: its blocks will be on the workers that get them, its
        prefill counts as queued on the worker that runs it until its first token, and it
        streams from `decode` (at most `max_tokens` tokens) until it leaves."""
        if p.remote and prefill is not None:
            self.prefixes.sent(prefill, p.hashes)
        self.prefixes.sent(decode, p.hashes)  # pulled or prefilled there, cached either way
        m = self.meter(prefill if p.remote and prefill is not None else decode)
        m.start(p.prefill_tokens)
        stream = _Stream(max_tokens, p.remote and prefill is not None)
        self.streams.setdefault(decode.worker_id, set()).add(stream)
        return Track(self, p, m, decode.worker_id, stream)

    def ended(self, worker_id: str, stream: _Stream) -> None:
        on = self.streams.get(worker_id)
        if on is not None:
            on.discard(stream)
            if not on:
                del self.streams[worker_id]

    def saw_gap(self, remote: bool, seconds: float) -> None:
        """A request's first-to-second-token gap, by where it prefilled."""
        self._gap[remote].add(seconds)

    def forget_except(self, worker_ids: set[str]) -> None:
        """Drop what is kept about workers that left."""
        for gone in self.meters.keys() - worker_ids:
            if self.meters[gone].pending <= 0:
                del self.meters[gone]
        self.prefixes.forget_except(worker_ids)


class Track:
    """One placed request's progress: the first token ends its prefill (the worker's meter
    learns the rate), the second one measures the gap its placement caused, and every token
    paces its stream for the TPOT check until it leaves."""

    __slots__ = ("_split", "_placement", "_meter", "_worker_id", "_stream", "_gap_open",
                 "_open")

    def __init__(self, split: PrefillSplit, placement: Placement, meter: PrefillMeter,
                 worker_id: str, stream: _Stream) -> None:
        self._split, self._placement, self._meter = split, placement, meter
        self._worker_id, self._stream = worker_id, stream
        self._gap_open = True  # until the gap is measured (or there is none to measure)
        self._open = True  # until the request leaves

    def tokens(self, n: int) -> None:
        if n <= 0 or not self._open:
            return
        now = self._split.clock()
        s = self._stream
        if s.first_at is None:
            self._meter.answered(self._placement.prefill_tokens)
            self._gap_open = n == 1  # a second token that came with the first leaves no gap
        elif self._gap_open:
            self._split.saw_gap(self._placement.remote, now - s.first_at)
            self._gap_open = False
        s.add(n, now)

    def close(self) -> None:
        """The request left these workers (finished, failed or cancelled)."""
        if not self._open:
            return
        self._open = False
        if self._stream.first_at is None:  # never answered
            self._meter.abandoned(self._placement.prefill_tokens)
        self._split.ended(self._worker_id, self._stream)
