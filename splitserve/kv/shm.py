"""Same-host fast path: a pull's bytes through a shared-memory segment instead of the pair channel.

The consumer owns one segment per producer connection, its staging buffer. It offers the segment
in its hello with a random nonce written at its start; a producer that can open the segment and
read the nonce back shares our /dev/shm (same host and IPC namespace: two containers of one pod,
not two pods) and says so, and from then on the connection has no pair channel at all: the
producer gathers a pull's blocks straight into the segment and the consumer scatters them straight
out of it, one memory copy on each side and no socket in between.

The side channel's pull request and reply are the synchronisation: the producer writes the
segment only between a pull request and its reply, the consumer reads it only after the reply and
before its next request on that connection (it holds the connection's lock throughout).

A producer that copies held blocks out (the CPU default) makes one more segment, its hold arena
(`HoldArena`), when the first consumer on this host connects, and copies each hold into it at
hold time. A pull of such a hold is answered with where the copy lies; the consumer maps the
arena read-only (once per connection) and scatters straight out of it, then says "read", and only
then does the producer free the span: one memory copy on the hand-off's path instead of two.

Leaks: the segment is created through `multiprocessing.shared_memory`, whose resource tracker
unlinks it if the consumer's process dies without doing so (SIGKILL included). The producer
attaches by opening /dev/shm directly, so it never registers (and so never unlinks, nor warns
about) a segment that is not its own. When the tracker dies too (a whole process group
SIGKILLed), the segment would stay: so its creator holds an exclusive `flock` on it for its
life, the kernel drops that lock with the creator's last descriptor however it dies, and each
process sweeps unlocked segments before making its first (`sweep_orphans`). A lock rather than a
pid in the name: two containers of one pod share /dev/shm but not their pid namespaces. Linux
only: elsewhere `available()` is false and the pair channel serves.

Whose segment is it? A process tree started with $SPLITSERVE_KV_SHM_TAG (8 hex digits) names
every segment it makes `splitserve-kv-<tag><16 random hex>`: on a host where several splitserves
share /dev/shm, `leftover_segments(tag)` lists one's own (a test run's leak check, an operator
after a crash). Without it the 24 hex digits are all random; either way a peer attaches alike.
"""

from __future__ import annotations

import bisect
import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

log = logging.getLogger(__name__)

PREFIX = "splitserve-kv-"
_NAME = re.compile(r"^splitserve-kv-[0-9a-f]{24}$")
TAG_ENV = "SPLITSERVE_KV_SHM_TAG"  # optional: the first 8 hex digits of our segments' names
_TAG = re.compile(r"^[0-9a-f]{8}$")
_DIR = "/dev/shm"
NONCE_BYTES = 16
MIN_BYTES = 1 << 20  # the first segment; it grows (geometrically) with the largest pull


def available() -> bool:
    return sys.platform == "linux" and os.path.isdir(_DIR)


ORPHAN_MIN_AGE_S = 60.0  # younger segments are left alone: their creator may not hold the lock yet


def leftover_segments(tag: str | None = None) -> list[str]:
    """Our segments present in /dev/shm now (for leak checks); with `tag`, only those made by
    processes that ran with $SPLITSERVE_KV_SHM_TAG = `tag` (module docstring)."""
    if tag is not None and not _TAG.match(tag):
        raise ValueError(f"a segment tag is 8 lowercase hex digits, got {tag!r}")
    start = PREFIX + (tag or "")
    return sorted(n for n in os.listdir(_DIR) if n.startswith(start)) if available() else []


def _new_name() -> str:
    """PREFIX, then $SPLITSERVE_KV_SHM_TAG if set, then random hex up to 24 digits."""
    tag = os.environ.get(TAG_ENV, "")
    if tag and not _TAG.match(tag):
        raise ValueError(f"${TAG_ENV} must be 8 lowercase hex digits, got {tag!r}")
    return PREFIX + tag + secrets.token_hex(12)[len(tag):]


def sweep_orphans(min_age_s: float = ORPHAN_MIN_AGE_S) -> list[str]:
    """Unlink our segments that no live process holds (their creator died with its resource
    tracker) and that were last changed over `min_age_s` ago; returns their names."""
    removed = []
    for name in leftover_segments():
        path = os.path.join(_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if time.time() - os.fstat(fd).st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator is alive
            os.unlink(path)
            removed.append(name)
        except OSError as e:
            log.debug("orphan segment %s not swept: %s", name, e)
        finally:
            os.close(fd)  # drops our lock too
    if removed:
        log.warning("removed %d shared-memory KV segment(s) left by dead processes: %s",
                    len(removed), ", ".join(removed))
    return removed


@functools.cache
def _sweep_once() -> None:
    """Once per process, before its first segment: enough to keep dead processes' segments from
    piling up across restarts, without a scan of /dev/shm for every segment made."""
    sweep_orphans()


class Segment:
    """A mapped segment; `tensor(n)` is a uint8 view of its first n bytes."""

    def __init__(self, name: str, buf, owner: shared_memory.SharedMemory | None) -> None:
        self.name = name
        self._buf = buf  # an mmap (attached) or the SharedMemory's memoryview (created)
        self._owner = owner
        self.size = len(buf)
        with warnings.catch_warnings():
            # A read-only map (a producer's hold arena, seen by a consumer) makes a tensor
            # torch calls non-writable; we only ever read from it.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self._flat = torch.frombuffer(buf, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment of at least `nbytes`; OSError (ENOSPC) when /dev/shm has no room,
        ValueError when $SPLITSERVE_KV_SHM_TAG is not 8 hex digits.

        Its pages are reserved now: a tmpfs that is too small (a container's default /dev/shm
        is 64 MiB) would otherwise accept the size and kill whoever first touches a page
        beyond its room with SIGBUS."""
        _sweep_once()
        shm = shared_memory.SharedMemory(name=_new_name(), create=True,
                                         size=max(nbytes, MIN_BYTES))
        try:
            # Held until close() closes the descriptor, or the kernel does at our death:
            # while it is held, no sweep takes the segment (module docstring).
            fcntl.flock(shm._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(shm._fd, 0, shm.size)
        except OSError:
            shm.close()
            shm.unlink()
            raise
        return cls(shm.name, shm.buf, shm)

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> Segment:
        """Open the peer's segment `name`; OSError if it is not here (another host or IPC
        namespace) or not ours to open."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise OSError(f"not a splitserve KV segment name: {name!r}")
        fd = os.open(os.path.join(_DIR, name), os.O_RDONLY if readonly else os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ if readonly
                           else mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, None)

    def tensor(self, nbytes: int, offset: int = 0) -> torch.Tensor:
        """`nbytes` from `offset` (ValueError when they are not inside the segment)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"span {offset}+{nbytes} is outside segment {self.name} "
                             f"({self.size} bytes)")
        return self._flat[offset:offset + nbytes]

    def write_nonce(self) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._buf[:NONCE_BYTES] = nonce
        return nonce.hex()

    def read_nonce(self) -> str:
        return bytes(self._buf[:NONCE_BYTES]).hex()

    def close(self) -> None:
        """Unmap; the owner also unlinks (the name goes at once, the memory with the last map)."""
        self._flat = None  # type: ignore[assignment]
        try:
            if self._owner is not None:
                try:
                    self._owner.close()
                finally:
                    self._owner.unlink()
            else:
                self._buf.close()
        except BufferError:
            # A view of it is still alive somewhere (an exception's traceback): the mapping
            # goes when that does; the name is already unlinked above.
            log.debug("segment %s still viewed at close", self.name)
        except FileNotFoundError:
            pass


class ConsumerStaging:
    """The consumer's segment for one producer connection, replaced by a bigger one as needed;
    and its read-only view of the producer's hold arena, once a pull has named it."""

    def __init__(self) -> None:
        self.segment = Segment.create(MIN_BYTES)
        self.nonce = self.segment.write_nonce()
        self.arena: Segment | None = None

    def offer(self) -> dict[str, str]:
        """What the hello carries: the producer proves it sees this segment."""
        return {"name": self.segment.name, "nonce": self.nonce}

    def buffer(self, nbytes: int) -> Segment:
        """A segment of at least `nbytes`; OSError when /dev/shm cannot hold a bigger one."""
        seg = self.segment
        if seg.size < nbytes:
            new = Segment.create(max(nbytes, 2 * seg.size))
            seg.close()
            self.segment = seg = new
        return seg

    def held(self, name: object, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` at `offset` of the producer's hold arena `name` (read-only; mapped on first
        use and kept: the producer has one arena for its life). OSError/ValueError when it is
        not there or the span is not inside it."""
        if self.arena is None or self.arena.name != name:
            seg = Segment.attach(name, readonly=True)  # type: ignore[arg-type]
            if self.arena is not None:
                self.arena.close()
            self.arena = seg
        return self.arena.tensor(nbytes, offset)

    def close(self) -> None:
        self.segment.close()
        if self.arena is not None:
            self.arena.close()


class ProducerAttachment:
    """The producer's view of one connection's consumer segment: re-attached when it is
    replaced (a pull names the segment it wants the bytes in)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    @classmethod
    def accept(cls, offer: object) -> ProducerAttachment | None:
        """Attach to the hello's offer if it is here and carries the nonce we read; None
        means "not the same host (or namespace)": the connection uses the pair channel."""
        if not isinstance(offer, dict):
            return None
        try:
            seg = Segment.attach(offer.get("name"))
        except (OSError, ValueError) as e:
            log.info("KV consumer's shared memory is not reachable here (%s): pair channel", e)
            return None
        if seg.size < NONCE_BYTES or seg.read_nonce() != offer.get("nonce"):
            seg.close()
            log.info("KV consumer's segment %s holds another nonce: pair channel", seg.name)
            return None
        return cls(seg)

    def buffer(self, name: object, nbytes: int) -> torch.Tensor:
        if name != self.segment.name:
            seg = Segment.attach(name)  # type: ignore[arg-type]
            self.segment.close()
            self.segment = seg
        return self.segment.tensor(nbytes)

    def close(self) -> None:
        self.segment.close()


# -- the producer's hold arena ----------------------------------------------------------------
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
            st = os.statvfs(_DIR)
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
