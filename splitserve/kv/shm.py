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

Leaks: the segment is created through `multiprocessing.shared_memory`, whose resource tracker
unlinks it if the consumer's process dies without doing so (SIGKILL included). The producer
attaches by opening /dev/shm directly, so it never registers (and so never unlinks, nor warns
about) a segment that is not its own. When the tracker dies too (a whole process group
SIGKILLed), the segment would stay: so its creator holds an exclusive `flock` on it for its
life, the kernel drops that lock with the creator's last descriptor however it dies, and each
process sweeps unlocked segments before making its first (`sweep_orphans`). A lock rather than a
pid in the name: two containers of one pod share /dev/shm but not their pid namespaces. Linux
only: elsewhere `available()` is false and the pair channel serves.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import sys
import time
import uuid
from multiprocessing import shared_memory

import torch

log = logging.getLogger(__name__)

PREFIX = "splitserve-kv-"
_NAME = re.compile(r"^splitserve-kv-[0-9a-f]{24}$")
_DIR = "/dev/shm"
NONCE_BYTES = 16
MIN_BYTES = 1 << 20  # the first segment; it grows (geometrically) with the largest pull


def available() -> bool:
    return sys.platform == "linux" and os.path.isdir(_DIR)


ORPHAN_MIN_AGE_S = 60.0  # younger segments are left alone: their creator may not hold the lock yet


def leftover_segments() -> list[str]:
    """Our segments present in /dev/shm now (for leak checks)."""
    return sorted(n for n in os.listdir(_DIR) if n.startswith(PREFIX)) if available() else []


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
        self._flat = torch.frombuffer(buf, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment of at least `nbytes`; OSError (ENOSPC) when /dev/shm has no room.

        Its pages are reserved now: a tmpfs that is too small (a container's default /dev/shm
        is 64 MiB) would otherwise accept the size and kill whoever first touches a page
        beyond its room with SIGBUS."""
        _sweep_once()
        shm = shared_memory.SharedMemory(name=PREFIX + uuid.uuid4().hex[:24], create=True,
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
    def attach(cls, name: str) -> Segment:
        """Open the consumer's segment `name`; OSError if it is not here (another host or IPC
        namespace) or not ours to open."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise OSError(f"not a splitserve KV segment name: {name!r}")
        fd = os.open(os.path.join(_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, None)

    def tensor(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.size:
            raise ValueError(f"segment {self.name} holds {self.size} bytes, {nbytes} asked")
        return self._flat[:nbytes]

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
    """The consumer's segment for one producer connection, replaced by a bigger one as needed."""

    def __init__(self) -> None:
        self.segment = Segment.create(MIN_BYTES)
        self.nonce = self.segment.write_nonce()

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

    def close(self) -> None:
        self.segment.close()


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
