"""Same-host path for copy-out holds: the consumer reads a held copy where it lies.

A producer that copies held blocks out (the CPU default) makes one more segment, its hold arena,
when the first consumer on this host connects, and copies each hold into it at hold time
(`hold_space`). A pull of such a hold is answered with where the copy lies; the consumer maps
the arena read-only (once per connection), scatters straight out of it and says Landed, and only
then does the producer free the span: one memory copy on the hand-off's path instead of two
(the producer's copy into the consumer's segment goes). A hold that found no room in the arena
lies in private memory and travels as on the shm path, through the consumer's segment, which
this path keeps for that.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
from dataclasses import dataclass

import torch

from splitserve.kv import blocks
from splitserve.kv.shm import MIN_BYTES, SHM_DIR, Segment
from splitserve.kv.transfers import Transfer
from splitserve.kv.transport import Held, Incoming, Place, Staged, TransportError
from splitserve.kv.transport.shm import ShmConsumerEnd, ShmKind, ShmOffer, ShmProducerEnd

log = logging.getLogger(__name__)

PATH = "arena"
ARENA_ALIGN = 4096


@dataclass(frozen=True, slots=True)
class Span:
    """A held copy's place in the arena."""

    offset: int
    nbytes: int


class HoldArena:
    """One shared segment the producer copies held KV into (copy-out holds), so that a consumer
    on this host scatters straight out of it: one memory copy on the hand-off's path instead of
    two (the producer's copy into the consumer's segment goes). Made when the first same-host
    consumer connects; a hold that finds no room in it takes private memory and travels the
    old way. Spans are first-fit from a free list (holds come and go roughly in order); freed
    ones coalesce."""

    def __init__(self, nbytes: int) -> None:
        self.segment = Segment.create(nbytes)
        self.name = self.segment.name
        self._lock = threading.Lock()  # the engine thread allocates, side-channel threads free
        self._free: list[tuple[int, int]] = [(0, self.segment.size)]  # (offset, size), sorted

    @classmethod
    def make(cls, want_bytes: int) -> HoldArena | None:
        """An arena of `want_bytes`, clipped to half of /dev/shm's free room (the consumers'
        segments need room too); None when that is under MIN_BYTES or the room is refused."""
        try:
            st = os.statvfs(SHM_DIR)
            nbytes = min(want_bytes, st.f_bavail * st.f_frsize // 2) // ARENA_ALIGN * ARENA_ALIGN
            if nbytes < MIN_BYTES:
                log.info("no KV hold arena: /dev/shm has %d bytes free", st.f_bavail * st.f_frsize)
                return None
            return cls(nbytes)
        except OSError as e:
            log.warning("no KV hold arena (%s): held KV stays in private memory", e)
            return None

    def alloc(self, nbytes: int) -> Span | None:
        size = -(-max(nbytes, 1) // ARENA_ALIGN) * ARENA_ALIGN
        with self._lock:
            for i, (off, room) in enumerate(self._free):
                if room >= size:
                    if room == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, room - size)
                    return Span(off, size)
        return None

    def free(self, span: Span) -> None:
        with self._lock:
            i = bisect.bisect(self._free, (span.offset, span.nbytes))
            self._free.insert(i, (span.offset, span.nbytes))
            # Coalesce with the right neighbour, then the left.
            if i + 1 < len(self._free) and span.offset + span.nbytes == self._free[i + 1][0]:
                self._free[i] = (span.offset, span.nbytes + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == span.offset:
                off, room = self._free.pop(i - 1)
                self._free[i - 1] = (off, room + self._free[i - 1][1])

    def tensor(self, span: Span, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of `span`, a uint8 view into the arena."""
        assert nbytes <= span.nbytes
        return self.segment.tensor(nbytes, span.offset)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(room for _, room in self._free)

    def close(self) -> None:
        self.segment.close()


class ArenaOffer(ShmOffer):
    """The shm offer, from a consumer that can also read a producer's arena."""

    kinds = (PATH, ShmOffer.key)

    def taken(self, kind: str, params: dict, link_key: str) -> ShmConsumerEnd:
        end = super().taken(kind, params, link_key)
        return ArenaConsumerEnd(self.staging, self.place) if kind == PATH else end


class ArenaConsumerEnd(ShmConsumerEnd):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.arena: Segment | None = None  # the producer's, read-only, once a pull named it

    def receive(self, move: dict, nbytes: int) -> Incoming:
        where = move.get("held")
        if where is None:
            return super().receive(move, nbytes)  # the hold did not fit the arena
        return Incoming(self._held(where, nbytes), PATH, landed=True)

    def _held(self, where: object, nbytes: int) -> torch.Tensor:
        """The pull's blocks as a staging view into the producer's arena (the positions of
        ours among the held ones when they are a subset: a copy then)."""
        kv = self.place.kv
        n = nbytes // blocks.staging_bytes(kv, 1)
        try:
            assert isinstance(where, dict)
            held, positions = int(where["blocks"]), where.get("positions")
            if self.arena is None or self.arena.name != where["name"]:
                seg = Segment.attach(where["name"], readonly=True)
                if self.arena is not None:
                    self.arena.close()
                self.arena = seg
            raw = self.arena.tensor(blocks.staging_bytes(kv, held), int(where["offset"]))
        except (AssertionError, KeyError, TypeError, ValueError, OSError) as e:
            raise TransportError(f"producer's hold arena: {e}") from e
        view = blocks.staging_view(raw, kv, held)
        if positions is None and held == n:
            return view
        if (not isinstance(positions, list) or len(positions) != n
                or not all(isinstance(i, int) and 0 <= i < held for i in positions)):
            raise TransportError(f"producer's hold arena: positions {positions} do not pick "
                                 f"{n} of its {held} held blocks")
        return view.index_select(1, torch.tensor(positions, dtype=torch.long))

    def close(self) -> None:
        super().close()
        if self.arena is not None:
            self.arena.close()


class ArenaKind(ShmKind):
    name = PATH

    def __init__(self, place: Place, nbytes: int) -> None:
        super().__init__(place)
        self.nbytes = nbytes
        self.arena: HoldArena | None = None
        self._lock = threading.Lock()
        self._tried = False

    def accept(self, offers: dict) -> ArenaProducerEnd | None:
        end = super().accept(offers)
        if end is None:
            return None
        with self._lock:  # once, before the welcome: the consumer's first pull may follow
            if not self._tried:
                self._tried = True
                self.arena = HoldArena.make(self.nbytes)
                if self.arena is not None:
                    log.info("KV hold arena %s: %d MiB", self.arena.name,
                             self.arena.segment.size >> 20)
        return ArenaProducerEnd(end.attached, self.place, self)

    def hold_space(self, nbytes: int) -> Held | None:
        arena = self.arena
        span = arena.alloc(nbytes) if arena is not None else None
        if span is None:
            return None
        return Held(arena.tensor(span, nbytes), functools.partial(arena.free, span), span)

    def close(self) -> None:
        arena, self.arena = self.arena, None  # later holds take private memory
        if arena is not None:
            arena.close()  # unlinks the name; consumers' maps stay valid until they unmap


class ArenaProducerEnd(ShmProducerEnd):
    def __init__(self, attached, place: Place, kind: ArenaKind) -> None:
        super().__init__(attached, place)
        self.kind = kind

    def stage(self, t: Transfer, want: list[int], move: dict) -> Staged:
        span = t.span.where if isinstance(t.span, Held) else None
        if not isinstance(span, Span):
            return super().stage(t, want, move)  # in private memory: through the segment
        arena = self.kind.arena
        if arena is None:
            raise TransportError("KV producer is shutting down")
        where = {b: i for i, b in enumerate(t.block_ids)}
        positions = [where[b] for b in want]
        return Staged({"held": {
            "name": arena.name, "offset": span.offset, "blocks": len(t.block_ids),
            "positions": None if positions == list(range(len(t.block_ids))) else positions}},
            PATH, landed=True)
